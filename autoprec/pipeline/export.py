"""What ``autoprec search`` writes when it ends: the best policy, every trial, the Pareto set,
and how the best compares with the target's AMP.

A write that fails (a full disk) never loses the result: the best policy is kept in the cache
folder (else the temporary folder, else printed on stdout) and the error says where.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

#: Speedups over AMP closer to 1 than this are "the same as AMP": the cost model's
#: predictions do not separate them, so only the loss delta's noise would.
AMP_SAME_SPEEDUP = 0.01
#: The columns of ``pareto.csv`` after ``file``.
PARETO_FIELDS = (
    "number",
    "reward",
    "loss_delta",
    "accuracy_delta",
    "speedup",
    "memory_ratio",
    "diverged",
)


class SearchExportError(ValueError):
    """The search finished but its files cannot be written (the error says where the best
    policy was kept instead)."""


@dataclass
class Exporter:
    """Writes a search's files and prints what they hold.

    Args:
        console: where the summary lines go.
        spec_module: the searched model (for the policies' ``model`` section).
        device: the target (its AMP precision for the comparison).
        out: the best policy's file; the trials go beside it (``<stem>.trials.csv``) or into
            ``pareto_dir``.
        pareto_dir: where one policy per Pareto point and ``pareto.csv`` go; None: nowhere.
    """

    console: Any
    spec_module: Any
    device: Any
    out: Path
    pareto_dir: Path | None
    policy_saved: bool = False  # whether the best policy's file is written

    def export(
        self,
        result: Any,
        policy: Any,
        amp: Any,
        amp_reward: float | None,
        rules: Sequence[tuple[str, Any, float]] = (),
    ) -> Path | None:
        """Write the best policy, the trials and the Pareto files; returns the best policy's
        path (None when no real evaluation finished).

        Args:
            result: the search's result.
            policy: its best policy, ready to save (None: no real evaluation finished).
            amp: the metrics of the target's AMP (None: not compared, e.g. interrupted).
            amp_reward: AMP's reward under the search's reward.
            rules: ``(name, metrics, reward)`` of the hand-written fp8 rules, compared with
                the best policy in one line.

        Raises:
            SearchExportError: a file cannot be written (the best policy is kept elsewhere).
        """
        from autoprec.cache import keep_text
        from autoprec.policy.io import format_policy, policy_format

        out = self.out
        try:
            return self._write(result, policy, amp, amp_reward, rules)
        except OSError as err:
            failed = err.filename or out
            why = err.strerror or str(err)
            if policy is None or self.policy_saved:
                kept = f" (the best policy is in {out})" if policy is not None else ""
                raise SearchExportError(f"cannot write {failed}: {why}{kept}") from None
            text = format_policy(policy, policy_format(out))
            kept = keep_text(out.name, text)
            if kept is None:
                click.echo(text, nl=False)
                where = "printed on stdout"
            else:
                where = f"kept in {kept}"
            raise SearchExportError(
                f"cannot write {failed}: {why}; the best policy is {where}: copy it to {out} "
                "once there is room"
            ) from None

    def _write(
        self,
        result: Any,
        policy: Any,
        amp: Any,
        amp_reward: float | None,
        rules: Sequence[tuple[str, Any, float]] = (),
    ) -> Path | None:
        """The files of :meth:`export`, the best policy first (the one that matters most)."""
        from rich.markup import escape  # a path holding "[x]" is text, not rich markup

        from autoprec.cache import write_csv
        from autoprec.policy.io import save_policy

        out = self.out
        trials_path = (
            self.pareto_dir / "trials.csv"
            if self.pareto_dir
            else out.with_name(out.stem + ".trials.csv")
        )
        if policy is None:
            write_csv(trials_path, result.summary_rows(real_only=False))
            self.console.print("no real evaluation finished; no policy written")
            return None
        save_policy(policy, out)
        self.policy_saved = True
        write_csv(trials_path, result.summary_rows(real_only=False))
        best = result.best
        m = best.metrics
        self.console.print(
            f"best policy -> {escape(str(out))}: reward {best.reward:.3f}, "
            f"speedup {m.speedup:.2f}x, memory {m.memory_ratio:.2f}x, "
            f"loss delta {m.loss_delta:+.4f} ({len(result.real_trials)} real evaluations)"
        )
        if amp_reward is not None:
            self._compare_with_amp(best, amp, amp_reward)
        if rules:
            self._compare_with_rules(best, rules)
        if self.pareto_dir:
            self._write_pareto(result, self.pareto_dir)
        return out

    def _compare_with_amp(self, best: Any, amp: Any, amp_reward: float) -> None:
        m = best.metrics
        low = self.device.preferred.low
        same_map = set(best.policy.values()) == {low}  # the best policy is blanket AMP
        same_cost = abs(m.speedup_vs_amp - 1.0) < AMP_SAME_SPEEDUP
        if same_map or same_cost:
            why = (
                "the best policy is blanket AMP itself"
                if same_map
                else f"predicted speedup within {AMP_SAME_SPEEDUP:.0%} of AMP's, the rest "
                "is fine-tuning noise"
            )
            self.console.print(
                f"same as AMP ({amp.speedup:.2f}x, loss delta {amp.loss_delta:+.4f}, "
                f"reward {amp_reward:.3f}): {why}"
            )
        elif best.reward > amp_reward:
            self.console.print(
                f"better than AMP ({amp.speedup:.2f}x, loss delta {amp.loss_delta:+.4f}, "
                f"reward {amp_reward:.3f}) under the reward"
            )
        else:
            self.console.print(
                f"[yellow]no policy better than AMP was found[/] (AMP reward "
                f"{amp_reward:.3f} >= best {best.reward:.3f}); the best found is written"
            )

    def _compare_with_rules(self, best: Any, rules: Sequence[tuple[str, Any, float]]) -> None:
        """One line: the best hand-written fp8 rule under the reward, and whether the searched
        policy beats it."""
        from rich.markup import escape

        name, m, reward = max(rules, key=lambda r: r[2])
        verdict = "better than" if best.reward > reward else "[yellow]not better than[/]"
        self.console.print(
            f"{verdict} the best of {len(rules)} hand-written fp8 rules, {escape(name)} "
            f"({m.speedup:.2f}x, loss delta {m.loss_delta:+.4f}, reward {reward:.3f})"
        )

    def _write_pareto(self, result: Any, folder: Path) -> None:
        """``pareto_NNN.yaml`` per Pareto point and ``pareto.csv`` listing them."""
        from rich.markup import escape

        from autoprec.cache import write_csv
        from autoprec.policy.io import save_policy

        rows = []
        for i, trial in enumerate(result.pareto):
            path = folder / f"pareto_{i:03d}.yaml"
            save_policy(result.policy_of(trial, self.spec_module), path)
            row = {**trial.row(), "reward": round(trial.reward, 6)}
            rows.append({"file": path.name, **{k: row[k] for k in PARETO_FIELDS}})
        write_csv(folder / "pareto.csv", rows)
        self.console.print(f"{len(rows)} Pareto policies -> {escape(str(folder))}")

"""What a search writes when it ends: the best policy, every trial, the Pareto set, and how
the best compares with the target's AMP and the hand-written rules.

A write that fails (a full disk) never loses the result: the best policy is kept in the cache
folder (else the temporary folder, else printed on stdout) and the error says where.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from autoprec.agents.result import SearchResult, Trial
    from autoprec.evaluate import Metrics
    from autoprec.hardware import DeviceSpec
    from autoprec.models import ModelSpec
    from autoprec.policy import PrecisionPolicy

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


@dataclass(frozen=True)
class Found:
    """What a search found, ready to export.

    Attributes:
        result: the search's result.
        policy: its best policy, ready to save (None: no real evaluation finished).
        amp: the metrics of the target's AMP (None: not compared, e.g. interrupted).
        amp_reward: AMP's reward under the search's reward.
        rules: ``(name, metrics, reward)`` of the hand-written rules, compared with the best
            policy in one line and listed one per line.
        rules_left_out: ``(name, why)`` of the hand rules that lower no layer of this model
            (:func:`autoprec.agents.hand_rules.hand_rules_left_out`), listed after them.
        rule_policies: ``{name: {layer: precision}}`` of the rules in ``rules``, written as
            policy files under ``pareto_dir/rules/`` (``autoprec verify --arms`` takes them).
    """

    result: SearchResult
    policy: PrecisionPolicy | None
    amp: Metrics | None = None
    amp_reward: float | None = None
    rules: Sequence[tuple[str, Metrics, float]] = ()
    rules_left_out: Sequence[tuple[str, str]] = ()
    rule_policies: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


@dataclass
class Exporter:
    """Writes a search's files and says what they hold.

    Args:
        line: where the summary lines go (rich markup).
        spec_module: the searched model (for the policies' ``model`` section).
        device: the target (its AMP precision for the comparison).
        out: the best policy's file; the trials go beside it (``<stem>.trials.csv``) or into
            ``pareto_dir``.
        pareto_dir: where one policy per Pareto point and ``pareto.csv`` go; None: nowhere.
    """

    line: Callable[[str], None]
    spec_module: ModelSpec | nn.Module
    device: DeviceSpec
    out: Path
    pareto_dir: Path | None
    policy_saved: bool = False  # whether the best policy's file is written
    verdicts: dict[str, str] = field(default_factory=dict)  # the comparisons' lines
    written: dict[str, Path] = field(default_factory=dict)  # the files, by what they hold

    def export(self, found: Found) -> Path | None:
        """Write the best policy, the trials and the Pareto files; returns the best policy's
        path (None when no real evaluation finished).

        Raises:
            SearchExportError: a file cannot be written (the best policy is kept elsewhere).
        """
        from autoprec.cache import keep_text
        from autoprec.policy.io import format_policy, policy_format

        out, policy = self.out, found.policy
        try:
            return self._write(found)
        except OSError as err:
            failed = err.filename or out
            why = err.strerror or str(err)
            if policy is None or self.policy_saved:
                kept = f" (the best policy is in {out})" if policy is not None else ""
                raise SearchExportError(f"cannot write {failed}: {why}{kept}") from None
            text = format_policy(policy, policy_format(out))
            kept = keep_text(out.name, text)
            if kept is None:
                sys.stdout.write(text)
                sys.stdout.flush()
                where = "printed on stdout"
            else:
                where = f"kept in {kept}"
            raise SearchExportError(
                f"cannot write {failed}: {why}; the best policy is {where}: copy it to {out} "
                "once there is room"
            ) from None

    def _write(self, found: Found) -> Path | None:
        """The files of :meth:`export`, the best policy first (the one that matters most)."""
        from rich.markup import escape  # a path holding "[x]" is text, not rich markup

        from autoprec.cache import write_csv
        from autoprec.policy.io import save_policy

        out, result, policy = self.out, found.result, found.policy
        trials_path = (
            self.pareto_dir / "trials.csv"
            if self.pareto_dir
            else out.with_name(out.stem + ".trials.csv")
        )
        self.written["trials"] = trials_path
        if policy is None:
            write_csv(trials_path, result.summary_rows(real_only=False))
            self.line("no real evaluation finished; no policy written")
            return None
        save_policy(policy, out)
        self.policy_saved = True
        self.written["policy"] = out
        write_csv(trials_path, result.summary_rows(real_only=False))
        best = result.best
        m = best.metrics
        self.line(
            f"best policy -> {escape(str(out))}: reward {best.reward:.3f}, "
            f"speedup {m.speedup:.2f}x, memory {m.memory_ratio:.2f}x, "
            f"loss delta {m.loss_delta:+.4f} ({len(result.real_trials)} real evaluations)"
        )
        if found.amp_reward is not None:
            self._say("amp", self._compare_with_amp(best, found.amp, found.amp_reward))
        if found.rules:
            self._say("hand_rules", self._compare_with_rules(best, found.rules))
        for text in _rule_lines(found.rules, found.rules_left_out):
            self.line(text)
        if self.pareto_dir:
            self._write_pareto(result, self.pareto_dir)
            self._write_rules(found, self.pareto_dir / "rules")
        return out

    def _say(self, name: str, verdict: str) -> None:
        self.verdicts[name] = verdict
        self.line(verdict)

    def _compare_with_amp(self, best: Trial, amp: Metrics, amp_reward: float) -> str:
        """The line that compares the best policy with the target's AMP."""
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
            return (
                f"same as AMP ({amp.speedup:.2f}x, loss delta {amp.loss_delta:+.4f}, "
                f"reward {amp_reward:.3f}): {why}"
            )
        if best.reward > amp_reward:
            return (
                f"better than AMP ({amp.speedup:.2f}x, loss delta {amp.loss_delta:+.4f}, "
                f"reward {amp_reward:.3f}) under the reward"
            )
        return (
            f"[yellow]no policy better than AMP was found[/] (AMP reward "
            f"{amp_reward:.3f} >= best {best.reward:.3f}); the best found is written"
        )

    def _compare_with_rules(self, best: Trial, rules: Sequence[tuple[str, Metrics, float]]) -> str:
        """One line: the best hand-written rule under the reward, and whether the searched
        policy beats it."""
        from rich.markup import escape

        name, m, reward = max(rules, key=lambda r: r[2])
        verdict = "better than" if best.reward > reward else "[yellow]not better than[/]"
        return (
            f"{verdict} the best of {len(rules)} hand-written rules, {escape(name)} "
            f"({m.speedup:.2f}x, loss delta {m.loss_delta:+.4f}, reward {reward:.3f})"
        )

    def _write_rules(self, found: Found, folder: Path) -> None:
        """``rules/<name>.yaml``: each evaluated hand rule's policy, for ``autoprec verify
        --arms`` (the search's export against the rules over whole runs)."""
        from rich.markup import escape

        from autoprec.agents.naming import file_safe
        from autoprec.policy.io import save_policy

        rules = [r for r in found.rules if r[0] in found.rule_policies]
        for name, metrics, reward in rules:
            policy = _rule_policy(found, name, metrics, reward, self.spec_module)
            save_policy(policy, folder / f"{file_safe(name)}.yaml")
        if rules:
            self.written["rules"] = folder
            self.line(f"{len(rules)} hand-rule policies -> {escape(str(folder))}")

    def _write_pareto(self, result: SearchResult, folder: Path) -> None:
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
        self.written["pareto"] = folder / "pareto.csv"
        self.line(f"{len(rows)} Pareto policies -> {escape(str(folder))}")


def _rule_policy(
    found: Found, name: str, metrics: Metrics, reward: float, spec_module: ModelSpec | nn.Module
) -> PrecisionPolicy:
    """Hand rule ``name``'s policy as a search exports its own (model, target, metrics)."""
    from autoprec.agents.export import export_policy, layer_policy, policy_metrics

    result = found.result
    return export_policy(
        layer_policy(found.rule_policies[name]),
        spec_module,
        target=result.target_info(),
        metrics={**policy_metrics(metrics), "reward": reward},
        provenance={"agent": "hand rule", "rule": name},
    )


def _rule_lines(
    rules: Sequence[tuple[str, Metrics, float]], left_out: Sequence[tuple[str, str]]
) -> list[str]:
    """Every hand rule on a line of its own: its speedup and memory under the cost model, its
    loss delta and its reward, then the rules left out and why (rich markup escaped)."""
    from rich.markup import escape

    if not rules and not left_out:
        return []
    width = max(len(name) for name, *_ in [*rules, *left_out])
    out = ["hand rules (speedup, memory, loss delta, reward):"]
    for name, m, reward in rules:
        flag = " (diverged)" if m.diverged else "" if m.feasible else " (not runnable)"
        out.append(
            f"  {escape(name):<{width}}  {m.speedup:.2f}x  {m.memory_ratio:.2f}x  "
            f"{m.loss_delta:+.4f}  {reward:.3f}{flag}"
        )
    out += [f"  {escape(name):<{width}}  left out: {escape(why)}" for name, why in left_out]
    return out

"""Training under a policy: production training (``autoprec train``, under ``torchrun`` too),
what is checked before a run starts, the one training engine and the user's recipe, checkpoints
and resume checks, the process-group helpers, and the fp32 warm start.

- :mod:`.run`: ``train`` (``mode="compiled"`` runs ``compile_policy``).
- :mod:`.checks`: what is checked before any step.
- :mod:`.recipe`: ``TrainingRecipe``, the user's optimizer (SGD or AdamW), rate, weight decay,
  warm-up, schedule and batch size, wherever autoprec trains.
- :mod:`.trainer`: ``Trainer``, the one training engine (step, divergence rule, split scorer,
  timing) of the fine-tunes, the warm start, ``train`` and ``verify``.
- :mod:`.checkpoint`: checkpoints and their resume checks.
- :mod:`.distributed`: the process-group helpers.
- :mod:`.pretrain`: the fp32 warm start's training and its rate back-off.

Names load from their modules; ``import autoprec.training`` imports nothing heavy.
"""

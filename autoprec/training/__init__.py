"""Training under a policy: production training (``autoprec train``, under ``torchrun`` too),
what is checked before a run starts, the loop, checkpoints and resume checks, the process-group
helpers, and the fp32 warm start.

- :mod:`.run`: ``train`` (``mode="compiled"`` runs ``compile_policy``).
- :mod:`.checks`: what is checked before any step.
- :mod:`.loop`: the step loop and validation.
- :mod:`.checkpoint`: checkpoints and their resume checks.
- :mod:`.distributed`: the process-group helpers.
- :mod:`.pretrain`: the fp32 warm start's training and its rate back-off.

Names load from their modules; ``import autoprec.training`` imports nothing heavy.
"""

"""``teacher-text``: token sequences sampled from a fixed random recurrent teacher, labelled by
their next token (a language-modelling task for ``token-classification`` models).

The teacher is a random echo-state network over the vocabulary: a state ``h`` of
:data:`TEACHER_DIM` units, updated by each token as ``h = tanh(W h + E[token])`` (``W`` a random
orthogonal matrix scaled by :data:`MEMORY`, so that earlier tokens fade over a few dozen steps),
and the next token drawn from ``softmax((U h) / TEMPERATURE + b)``, where ``b`` gives the tokens
unequal frequencies as in text. The first token is uniform. Position ``i``'s input is token
``i`` and its label token ``i + 1``, so a sequence of ``seq_len`` inputs is ``seq_len + 1``
tokens drawn.

The next token depends mostly on the current one (a bigram table gets most of the way) and
then on the context the state remembers. At the defaults (vocabulary 512, 64 tokens, seed 0;
log 512 = 6.24 nats): the teacher's own conditional entropy, the best loss any model can reach,
is about 3.2 nats; the unigram frequencies give 5.7 and smoothed bigram counts over the
training split 3.8. The zoo's ``llama``, trained as the evaluator's warm start trains (SGD, lr
0.05, momentum 0.9, batch 32), goes from 6.4 to a validation loss of 4.2 in 200 steps and 4.06
in 300 (AdamW at 3e-3: 3.9 in 300). Everything is seeded by ``seed`` (teacher and samples,
from separate streams); nothing is downloaded, and 4096 sequences of 64 take about a second.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from autoprec.data._base import (
    DataBundle,
    DataRequest,
    check_num_classes,
    next_token_task,
    rng,
    split_indices,
    token_geometry,
)

DEFAULT_SAMPLES = 4096
TEACHER_DIM = 64
MEMORY = 0.9  # spectral radius of the recurrence: a token's trace fades as 0.9 ** distance
INPUT_GAIN = 2.0  # scale of the token embeddings: how much the current token decides
TEMPERATURE = 0.3  # of the next-token softmax: neither uniform noise nor deterministic
UNIGRAM_STD = 1.0  # spread of the per-token log-frequency offsets


def _teacher(vocab: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(E, W, U, b)``: embeddings, recurrence, readout (divided by the temperature), bias."""
    embed = INPUT_GAIN * torch.randn(vocab, TEACHER_DIM, generator=generator)
    q, _ = torch.linalg.qr(torch.randn(TEACHER_DIM, TEACHER_DIM, generator=generator))
    readout = torch.randn(vocab, TEACHER_DIM, generator=generator) / math.sqrt(TEACHER_DIM)
    bias = UNIGRAM_STD * torch.randn(vocab, generator=generator)
    return embed, MEMORY * q, readout / TEMPERATURE, bias


@torch.no_grad()
def sample_sequences(
    n: int, length: int, vocab: int, seed: int = 0, *, entropy: bool = False
) -> tuple[Tensor, float]:
    """``n`` sequences of ``length`` tokens from the teacher of ``seed``.

    Args:
        n: sequences.
        length: tokens per sequence (the first uniform, each later one drawn from the teacher).
        vocab: token ids are in ``[0, vocab)``.
        seed: seeds the teacher and the draws (separate streams).
        entropy: also compute the teacher's mean conditional entropy over the drawn positions
            (nats): the loss of a model that knew the teacher.

    Returns:
        ``(ids, entropy)``: ids ``(n, length)`` int64; entropy NaN unless asked for.
    """
    embed, recur, readout, bias = _teacher(vocab, rng(seed, "teacher-text-net"))
    gen = rng(seed, "teacher-text-sample")
    ids = torch.empty(n, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (n,), generator=gen)
    uniforms = torch.rand(n, max(length - 1, 0), generator=gen)
    state = torch.zeros(n, TEACHER_DIM)
    total = 0.0
    for t in range(length - 1):
        state = torch.tanh(torch.addmm(embed[ids[:, t]], state, recur.T))
        logits = torch.addmm(bias, state, readout.T)
        probs = torch.softmax(logits, dim=-1)
        if entropy:
            total += float(-(probs * torch.log_softmax(logits, dim=-1)).sum(-1).mean())
        cdf = probs.cumsum_(dim=-1)  # inverse-CDF draw: one uniform per sequence and step
        draw = torch.searchsorted(cdf, uniforms[:, t : t + 1] * cdf[:, -1:])
        ids[:, t + 1] = draw[:, 0].clamp_max_(vocab - 1)
    return ids, (total / (length - 1) if entropy and length > 1 else math.nan)


def load_teacher_text_bundle(req: DataRequest) -> DataBundle:
    """Next-token prediction on teacher sequences shaped for ``req``; see the module doc."""
    name = req.name
    task = next_token_task(req)
    vocab, seq_len = token_geometry(req)
    num_classes = check_num_classes(name, vocab, req.num_classes)
    ids, _ = sample_sequences(req.max_samples or DEFAULT_SAMPLES, seq_len + 1, vocab, req.seed)
    train, val = split_indices(len(ids), seed=req.seed, val_fraction=req.val_fraction)
    return DataBundle(
        name=name,
        train=TensorDataset(ids[train, :-1], ids[train, 1:]),
        val=TensorDataset(ids[val, :-1], ids[val, 1:]),
        num_classes=num_classes,
        input_shape=req.input_shape,
        task=task,
        key="",
        vocab_size=vocab,
    )

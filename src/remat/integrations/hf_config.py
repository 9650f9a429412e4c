"""A ``transformers`` model from a local ``config.json``, built on the ``meta`` device, and its
training step planned by a dry run (``remat plan``, ``bench/plan_large.py``).

Nothing is downloaded and nothing of the model's size is allocated: an 8-billion-parameter Llama
builds in under a second. Importing this module imports ``transformers``; ``import remat`` does not.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

OPTIMIZERS = ("adamw", "adam", "sgd", "none")
WEIGHTS = ("fp32", "bf16")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_config(path: str | Path, **overrides: Any):
    """The ``transformers`` config a ``config.json`` (or a folder holding one) describes, its
    ``model_type`` naming the class; ``overrides`` set fields (``num_hidden_layers=2``)."""
    import transformers as tf

    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"no config file at {p} (give a config.json or a folder holding one)")
    data = json.loads(p.read_text())
    kind = data.get("model_type")
    if kind not in tf.CONFIG_MAPPING:
        raise ValueError(f"{p}: model_type {kind!r} is not a transformers model type (e.g. 'llama', 'gpt2')")
    data.update(overrides)
    data["use_cache"] = False  # training: no key-value cache
    return tf.CONFIG_MAPPING[kind].from_dict(data)


@dataclass
class MetaModel:
    """A causal language model on ``meta``, its keyword inputs (``input_ids``, ``labels``), its optimizer."""

    model: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    optimizer: Any
    parameters: int   # all of them
    trainable: int    # those the optimizer updates (LoRA: the adapters')


def meta_model(config, batch: int, seq: int, weights: str = "fp32", optimizer: str = "adamw",
               lora: int | None = None, lora_targets: Sequence[str] = DEFAULT_LORA_TARGETS) -> MetaModel:
    """``AutoModelForCausalLM`` of ``config`` on ``meta`` with weights in ``weights`` ("fp32" or
    "bf16"), ``batch`` x ``seq`` token inputs and labels, and the optimizer over its trainable
    parameters; with ``lora=r``, LoRA adapters of rank r on ``lora_targets`` (peft), the base frozen."""
    import transformers as tf

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        if lora:
            from peft import LoraConfig, get_peft_model

            present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
            targets = [t for t in lora_targets if t in present]
            model = get_peft_model(model, LoraConfig(r=lora, lora_alpha=2 * lora, lora_dropout=0.0,
                                                     target_modules=targets))
        ids = torch.zeros(batch, seq, dtype=torch.long)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = {"adamw": lambda: torch.optim.AdamW(params), "adam": lambda: torch.optim.Adam(params),
           "sgd": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9), "none": lambda: None}[optimizer]()
    return MetaModel(model, dict(input_ids=ids, labels=ids.clone()), opt,
                     sum(p.numel() for p in model.parameters()), sum(p.numel() for p in params))


def plan_config(config, batch: int, seq: int, *, precision: str = "bf16", weights: str = "fp32",
                optimizer: str = "adamw", lora: int | None = None, device=None, budget=None,
                progress: Callable[[str], None] | None = None, **options: Any):
    """The training step of ``config``'s causal LM planned by a dry run (``remat.compile(...,
    dry_run=True)``): the planned step (``report()``, ``curve()``; not callable), and the :class:`MetaModel`."""
    from ..train.api import compile

    m = meta_model(config, batch, seq, weights, optimizer, lora)
    step = compile(m.model, m.inputs, None, optimizer=m.optimizer, budget=budget, dry_run=True, device=device,
                   precision=precision, progress=progress, **options)
    return step, m


__all__ = ["MetaModel", "load_config", "meta_model", "plan_config"]

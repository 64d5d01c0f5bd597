"""The hf engine's side of `vllm.sync.mode: adapter`: the server keeps a float32 copy of the base weights
of every targeted layer, receives only the adapter tensors (named as peft names them, float32), and
writes base + adapter merged into the serving model (`stagectl.models.lora.merge_weight`, the function
the learner's checkpoints use, so a server and a checkpoint's `model/` hold bit-identical weights).

A sync is verified like a full sync: every adapter tensor of every layer must arrive (the adapter is the
engine's whole weight set in this mode)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from stagectl.config.model_data import AdapterConfig
from stagectl.engines.interface import TensorSpec
from stagectl.models.lora import LORA_A, LORA_B, MAGNITUDE, adapter_shapes, merge_weight, target_layers


class AdapterMerger:
    def __init__(self, model: nn.Module, cfg: AdapterConfig) -> None:
        """Call on the model in float32 (before it is cast to the serving dtype): the base copies are
        the learner's float32 base exactly."""
        layers = target_layers(model, cfg.target_modules)
        if not layers:
            raise ValueError(
                f"model.adapter.target_modules {cfg.target_modules}: no such linear layer in the language model"
            )
        self.scaling = cfg.alpha / cfg.r
        self.dora = cfg.type == "dora"
        self.base = {name: layer.weight.detach().float().clone() for name, layer in layers.items()}
        self.specs: dict[str, TensorSpec] = {}
        for name, layer in layers.items():
            for suffix, shape in adapter_shapes(
                layer.out_features, layer.in_features, cfg.r, self.dora
            ).items():
                self.specs[name + suffix] = TensorSpec(shape=shape, dtype="float32")
        self.current: dict[str, torch.Tensor] = {}  # the adapter tensors last applied

    def merged(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`{<layer>.weight: merged float32}` for every layer `weights` touches (the layer's other adapter
        tensors from earlier syncs)."""
        current = {**self.current, **{k: v.detach().clone() for k, v in weights.items()}}
        touched = {name for name in self.base if any(k.startswith(name + ".") for k in weights)}
        out = {}
        for name in touched:
            magnitude = current[name + MAGNITUDE] if self.dora else None
            out[f"{name}.weight"] = merge_weight(
                self.base[name], current[name + LORA_A], current[name + LORA_B], self.scaling, magnitude
            )
        self.current = current
        return out

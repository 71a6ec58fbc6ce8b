"""The FSDP2 training engine: one per torchrun rank, driven in lockstep by the controller (one float32 rank alone
trains the unsharded model: ``_shards``).

``setup``, ``token_logprobs``, ``sequence_logprobs``, ``train_step``, ``full_state_dict``, ``adapter_tensors``,
``export_hf`` and ``export_weights`` are collective: all ranks call them, in the same order, or the group hangs
until the process-group timeout. Each rank passes its own share of the global batch.

Conventions (see ``batch.py`` for the data layout):

- Logprobs are those of the sampled next token under ``log_softmax(logits / temperature)``, the tempered
  distribution the inference server reports, so ratios against the server's logprobs compare like with like.
- ``train_step`` hands ``loss_fn(logprobs, microbatch, normalizer)`` the GLOBAL counts of loss tokens and
  of sequences with a loss token (summed over ranks on the meta group). A loss function that divides its
  micro-batch's sum by them makes the micro-batch losses of all ranks add up to the whole batch's loss.
- FSDP2 averages gradients over ranks by default; this engine makes the reduce-scatter a plain SUM (see
  ``_sum_gradients_over_ranks``), so the summed gradient is the gradient of the whole global batch and two
  ranks train exactly like one process that sees the whole batch.
- With ``train.lora.rank > 0`` the model is peft's, adapters around the frozen base (``lora.py``), wrapped
  before FSDP2 shards it; the optimizer holds the adapters only, and what goes out (``export_hf``,
  ``export_weights``, ``adapter_tensors``) is the adapter in PEFT's layout.
"""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hpcrl.config.schema import TrainConfig
from hpcrl.rundir import write_dir_atomic
from hpcrl.train import lora
from hpcrl.train.batch import MicroBatch, Normalizer, Sequence, check_optional_fields, collate
from hpcrl.train.dist import DistInfo, init_distributed
from hpcrl.train.microbatch import plan

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

LossFn = Callable[[Tensor, MicroBatch, Normalizer], tuple[Tensor, Mapping[str, float | Tensor]]]
DTYPES = ("float32", "bfloat16", "float16")
LR_SCHEDULES = ("constant", "cosine")
# keys train_step reports itself; a loss_fn metric may not reuse them
STEP_METRICS = ("loss", "grad_norm", "lr", "tokens", "loss_tokens", "sequences", "microbatches", "step")
# weight files of a Hugging Face directory; export_hf writes its own, and copies everything else
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
_WRITTEN_BY_SAVE = ("config.json", "generation_config.json", "model.safetensors.index.json")
WEIGHTS_FILE = "model.safetensors"  # export_weights' one file, the name save_pretrained gives an unsharded model


class Engine:
    """A causal LM sharded with FSDP2 over the trainer ranks, with AdamW and an LR schedule.

    The constructor only checks its arguments; ``setup()`` loads and shards the model, so a failure there
    reaches the caller as an exception of that call.
    """

    def __init__(
        self,
        model_path: str | Path,
        train: TrainConfig,
        dtype: str = "float32",
        dist: DistInfo | None = None,
        total_steps: int = 0,
        updates_per_step: int = 1,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {DTYPES}, got {dtype!r}")
        if train.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"train.lr_schedule must be one of {LR_SCHEDULES}, got {train.lr_schedule!r}")
        if updates_per_step < 1:
            raise ValueError(f"updates_per_step must be >= 1 (algorithm.updates_per_batch), got {updates_per_step}")
        if train.lr_schedule == "cosine" and total_steps <= train.warmup_steps:
            raise ValueError(
                f"train.lr_schedule=cosine decays over total_steps={total_steps}, which must exceed "
                f"train.warmup_steps={train.warmup_steps}; pass the run's step budget (run.max_steps)"
            )
        if train.micro_batch_tokens < 1:
            raise ValueError(f"train.micro_batch_tokens must be >= 1, got {train.micro_batch_tokens}")
        if train.grad_clip < 0:
            raise ValueError(f"train.grad_clip must be >= 0 (0 = off), got {train.grad_clip}")
        self.model_path = Path(model_path)
        self.train = train
        self.dtype = dtype
        self.dist = dist
        # the schedule counts optimizer updates: a run step takes updates_per_step of them
        self.warmup_updates = train.warmup_steps * updates_per_step
        self.total_updates = total_steps * updates_per_step
        self.step = 0  # optimizer steps taken; checkpoints save and restore it
        self.model: PreTrainedModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.pad_id = 0

    # ---- setup -------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Load the model from ``model_path``, shard it per decoder layer and at the root, build the optimizer.

        One rank computing in float32 is not sharded (``_shards``): FSDP2 would split nothing and cast nothing,
        and its hooks and DTensors cost 10-18% of a small model's update in one process (``bench/train_step.py``),
        more inside the default job (bench/README.md)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if self.dist is None:
            self.dist = init_distributed()
        info = self.dist
        model, layers, config = self._load_model()
        self.pad_id = next((i for i in (config.pad_token_id, config.eos_token_id) if isinstance(i, int)), 0)
        if self.lora:  # before fully_shard: the adapters live inside the layers it shards
            model = lora.wrap(model, self.train.lora, self.model_path)
        mp_policy = self._mixed_precision(info.device)
        sharded = _shards(info.world_size, mp_policy)
        if sharded:
            mesh = init_device_mesh(info.device.type, (info.world_size,))
            for layer in layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
            fully_shard(model, mesh=mesh, mp_policy=mp_policy)
            _sum_gradients_over_ranks(model)
        else:
            model.to(info.device)  # where fully_shard would have put it
        self.model = model
        # fused: one kernel over all parameters instead of about ten DTensor-dispatched ops per parameter
        # (the tiny model's step 16 -> 2 ms on this CPU, bench/README.md); the same update up to rounding
        # the trainable parameters only: with LoRA the adapters (the frozen base has no gradient and no state)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trainable, lr=self.train.lr, weight_decay=self.train.weight_decay, fused=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        params = sum(p.numel() for p in model.parameters())  # DTensor numel is the full (global) size
        logger.info(
            "model %s: %.2fM parameters (%.2fM trainable), %d layers %s on %s, compute dtype %s",
            self.model_path,
            params / 1e6,
            sum(p.numel() for p in trainable) / 1e6,
            len(layers),
            f"sharded over {info.world_size} rank(s)" if sharded else "on one rank, not sharded",
            info.device,
            mp_policy.param_dtype or torch.float32,
        )

    def _load_model(self) -> tuple[nn.Module, nn.ModuleList, object]:
        """The model in float32 (master weights; a bf16 policy only changes what forward/backward compute in),
        its decoder layers (each sharded on its own) and its config (for the pad id)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(
                f"{self.model_path}: expected a decoder-only model with model.model.layers (Llama/Qwen layout), "
                f"got {type(model).__name__}"
            )
        return model, layers, model.config

    def _mixed_precision(self, device: torch.device):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.dtype == "bfloat16" and device.type == "cuda" and torch.cuda.is_bf16_supported():
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.dtype != "float32":
            reason = (
                "float16 training needs loss scaling, which this engine does not do"
                if self.dtype == "float16"
                else "bfloat16 compute needs a CUDA device that supports it"
            )
            logger.warning(
                "model.dtype=%s is ignored on %s: training computes in float32 (%s)", self.dtype, device, reason
            )
        return MixedPrecisionPolicy()

    def _lr_factor(self, update: int) -> float:
        """The learning rate of optimizer update ``update`` (from 0) over ``train.lr``: a linear warm-up over
        ``warmup_updates``, then constant or a cosine that reaches 0 after the run's last update (``total_updates``),
        so the last update still learns, at the smallest rate of the run."""
        warmup = self.warmup_updates
        if update < warmup:
            return (update + 1) / warmup  # the first update already learns, at lr / warmup
        if self.train.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (update - warmup) / (self.total_updates - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    @property
    def lora(self) -> bool:
        """Whether the policy trains LoRA adapters (``train.lora.rank > 0``) instead of its weights."""
        return self.train.lora.rank > 0

    def require_setup(self) -> tuple[PreTrainedModel, DistInfo]:
        """The sharded model and this rank's ``DistInfo``; RuntimeError before ``setup()``."""
        if self.model is None or self.dist is None:
            raise RuntimeError("Engine.setup() has not run; call it once before using the engine")
        return self.model, self.dist

    # ---- forward -----------------------------------------------------------------------------------

    def _forward(self, input_ids: Tensor, attention_mask: Tensor, temperature: float) -> Tensor:
        """What the loss function gets, ``[B, T-1]`` aligned with a MicroBatch: the policy's token logprobs."""
        return self._logprobs(input_ids, attention_mask, temperature)

    def _logprobs(self, input_ids: Tensor, attention_mask: Tensor, temperature: float) -> Tensor:
        model, _ = self.require_setup()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logits = logits[:, :-1].float() / temperature
        targets = input_ids[:, 1:].unsqueeze(-1)
        # gather - logsumexp == log_softmax gathered, without a second [B, T, vocab] tensor
        return (logits.gather(-1, targets) - logits.logsumexp(dim=-1, keepdim=True)).squeeze(-1)

    @torch.no_grad()
    def token_logprobs(self, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0) -> Tensor:
        """``[B, T-1]`` logprob of each next token ``input_ids[:, t+1]`` under ``log_softmax(logits / T)``.

        Rows are right-padded; values at padded positions are meaningless. Collective: one FSDP forward.
        """
        model, info = self.require_setup()
        model.eval()
        return self._logprobs(input_ids.to(info.device), attention_mask.to(info.device), temperature)

    def sequence_logprobs(self, sequences: list[Sequence], temperature: float = 1.0) -> list[list[float]]:
        """Per-token logprobs of ``sequences`` aligned with their ``input_ids`` (entry 0 is 0.0).

        Micro-batched like ``train_step`` (ranks agree on the count), for recomputing old, proximal or
        reference logprobs of a batch that does not fit in one forward.
        """
        return self._per_sequence(sequences, temperature)

    @torch.no_grad()
    def _per_sequence(self, sequences: list[Sequence], temperature: float) -> list[list[float]]:
        """``_forward`` of every sequence, micro-batched, as lists aligned with its ``input_ids`` (entry 0 is 0.0:
        column t of the forward is about token t + 1). Collective."""
        model, info = self.require_setup()
        model.eval()
        lengths = [len(s.input_ids) for s in sequences]
        result: list[list[float]] = [[] for _ in sequences]
        for items in plan(lengths, self.train.micro_batch_tokens, info.meta_group):
            if not items:
                self._forward(*self._dummy_inputs(), temperature)  # keeps FSDP's all-gathers matched
                continue
            mb = collate([sequences[i] for i in items], self.pad_id, info.device)
            out = self._forward(mb.input_ids, mb.attention_mask, temperature).cpu()
            for row, i in enumerate(items):
                result[i] = [0.0, *out[row, : lengths[i] - 1].tolist()]
        return result

    def _dummy_inputs(self) -> tuple[Tensor, Tensor]:
        device = self.require_setup()[1].device
        return torch.full((1, 2), self.pad_id, dtype=torch.long, device=device), torch.ones(
            (1, 2), dtype=torch.long, device=device
        )

    # ---- train -------------------------------------------------------------------------------------

    def train_step(self, sequences: list[Sequence], loss_fn: LossFn, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on this rank's ``sequences`` (its share of the global batch).

        ``loss_fn(outputs [B, T-1], microbatch, normalizer) -> (loss, metrics)`` runs once per non-empty
        micro-batch (``outputs``: ``_forward``'s, the policy's token logprobs here, a critic's values in
        ``ValueEngine``); its loss should be the micro-batch's partial sum divided by a ``normalizer`` count.
        Its metrics are read as per-micro-batch means over loss tokens and reported as the loss-token
        weighted mean over the global batch; one whose name ends in ``_max`` as the max over micro-batches and ranks.
        Returns global ``loss`` (sum of all partial losses),
        ``grad_norm`` (before clipping), ``lr`` (used by this step), ``tokens``, ``loss_tokens``,
        ``sequences``, this rank's ``microbatches`` (equal on every rank) and ``step`` (after it).
        """
        model, info = self.require_setup()
        assert self.optimizer is not None and self.scheduler is not None
        for i, seq in enumerate(sequences):
            seq.validate(i)
        check_optional_fields(sequences)
        lengths = [len(s.input_ids) for s in sequences]
        bins = plan(lengths, self.train.micro_batch_tokens, info.meta_group)
        loss_tokens, loss_sequences, tokens, global_sequences = self._sum_over_ranks(
            [
                sum(s.loss_tokens for s in sequences),
                sum(1 for s in sequences if s.loss_tokens),
                sum(lengths),
                len(sequences),
            ]
        )
        if loss_tokens == 0:
            # every rank sees the same global count, so every rank raises here and none waits
            raise ValueError(
                f"the global batch ({int(tokens)} tokens) has no token with loss_mask 1; nothing to train on"
            )
        normalizer = Normalizer(tokens=int(loss_tokens), sequences=int(loss_sequences))

        model.train()
        self.optimizer.zero_grad(set_to_none=True)  # nothing left over from a step that raised
        loss_sum = torch.zeros((), dtype=torch.float64)
        weighted: dict[str, float] = {}
        maxima: dict[str, float] = {}
        for items in bins:
            if not items:
                # a forward/backward of zero weight: this rank ran out of sequences, yet FSDP's
                # all-gathers and reduce-scatters must match the other ranks' micro-batches one for one
                (self._forward(*self._dummy_inputs(), temperature).sum() * 0.0).backward()
                continue
            mb = collate([sequences[i] for i in items], self.pad_id, info.device)
            loss, metrics = loss_fn(self._forward(mb.input_ids, mb.attention_mask, temperature), mb, normalizer)
            loss.backward()
            loss_sum += loss.detach().double().cpu()
            weight = float(mb.loss_mask.sum())
            for name, value in metrics.items():
                if name.endswith("_max"):
                    maxima[name] = max(maxima.get(name, -math.inf), float(value))
                else:
                    weighted[name] = weighted.get(name, 0.0) + float(value) * weight

        # inf: never clip, but still compute the global norm (a DTensor; clip_grad_norm_ reduces over the mesh)
        max_norm = self.train.grad_clip if self.train.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(grad_norm):
            # the norm is global, so every rank raises here together, before any weight changes
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"step {self.step + 1}: the gradient norm is {grad_norm}; the optimizer step was skipped and the "
                "weights are unchanged. Look for inf/NaN in the loss function or the batch's logprobs and advantages"
            )
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

        (total_loss,) = self._sum_over_ranks([float(loss_sum)])
        result = {
            "loss": total_loss,
            "grad_norm": grad_norm,
            "lr": float(lr),
            "tokens": float(tokens),
            "loss_tokens": float(loss_tokens),
            "sequences": global_sequences,
            "microbatches": float(len(bins)),
            "step": float(self.step),
        }
        result.update(self._reduce_metrics(weighted, maxima, loss_tokens))
        return result

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over all ranks, on the gloo meta group (float64, exact for counts). One
        rank alone sends nothing (a collective of one is still ~25 us, an object gather ~165 us, each step)."""
        tensor = torch.tensor(values, dtype=torch.float64)
        info = self.require_setup()[1]
        if info.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=info.meta_group)
        return tensor.tolist()

    def _reduce_metrics(
        self, weighted: dict[str, float], maxima: dict[str, float], loss_tokens: float
    ) -> dict[str, float]:
        """The loss-token weighted means of ``weighted``'s sums and the maxima of ``maxima`` over every rank."""
        info = self.require_setup()[1]
        # a rank whose micro-batches were all empty has no names: agree on the union first
        names: list[list[str]] = [sorted({*weighted, *maxima})]
        if info.world_size > 1:
            names = [[] for _ in range(info.world_size)]
            dist.all_gather_object(names, sorted({*weighted, *maxima}), group=info.meta_group)
        union = sorted({name for rank_names in names for name in rank_names})
        clash = [name for name in union if name in STEP_METRICS]
        if clash:
            raise ValueError(f"loss_fn metrics {clash} clash with train_step's own metrics {STEP_METRICS}; rename them")
        means = [name for name in union if not name.endswith("_max")]
        sums = self._sum_over_ranks([weighted.get(name, 0.0) for name in means])
        result = {name: value / loss_tokens for name, value in zip(means, sums, strict=True)}
        if peaks := [name for name in union if name.endswith("_max")]:
            tensor = torch.tensor([maxima.get(name, -math.inf) for name in peaks], dtype=torch.float64)
            if info.world_size > 1:
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=info.meta_group)
            result.update(zip(peaks, tensor.tolist(), strict=True))
        return result

    # ---- weights out -------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, Tensor]:
        """The unsharded float32 state dict on the CPU of rank 0; ``{}`` on the other ranks. Collective: one
        all-gather per dtype (``hpcrl.train.gather``), not one per tensor."""
        from hpcrl.train.gather import gather_full_state_dict

        model, info = self.require_setup()
        return gather_full_state_dict(model, info.is_main)

    def adapter_tensors(self) -> dict[str, Tensor]:
        """With LoRA: the adapter's float32 tensors by PEFT name (``adapter_model.safetensors``'), unsharded on the
        CPU of rank 0; ``{}`` on the other ranks. Collective: one all-gather of the adapters, not of the base."""
        from hpcrl.train.gather import gather_full_state_dict

        model, info = self._require_lora("adapter_tensors")
        state = gather_full_state_dict(model, info.is_main, names=lora.adapter_names(model))
        return lora.peft_names(model, state) if info.is_main else {}

    def adapter_config(self) -> dict:
        """With LoRA: the adapter's ``adapter_config.json`` as a dict (SGLang's ``config_dict``). Local."""
        model, _ = self._require_lora("adapter_config")
        return lora.adapter_config(model)

    def _require_lora(self, what: str) -> tuple[PreTrainedModel, DistInfo]:
        if not self.lora:
            raise ValueError(f"{what} is the LoRA adapter's, but this engine trains full weights (train.lora.rank=0)")
        return self.require_setup()

    def export_hf(self, out_dir: str | Path, merged: bool = False) -> Path:
        """Write the model in the Hugging Face layout (safetensors) plus the tokenizer files to ``out_dir``.

        With LoRA the weights are the adapter's, in PEFT's layout (``adapter_config.json``,
        ``adapter_model.safetensors``: ``peft.PeftModel.from_pretrained(base, out_dir)`` loads it), and with
        ``merged`` (``export.merged``) also ``out_dir/merged/``: the base with the adapter merged in, in the Hugging
        Face layout, with the tokenizer files. Without LoRA ``merged`` is refused: the export is the whole model.

        Rank 0 writes into a sibling temporary directory and renames it, so a reader never sees half a
        model; an existing ``out_dir`` is replaced. Other ranks return once it is in place. Collective.
        """
        model, info = self.require_setup()
        out = Path(out_dir)
        if self.lora:
            return self._export_adapter(out, merged, info)
        if merged:
            raise ValueError("export.merged applies to LoRA only (train.lora.rank > 0): this export is the whole model")
        state = _drop_tied_duplicates(model, self.full_state_dict())

        def fill(tmp: Path) -> None:
            # save_pretrained empties the dict it is given (transformers 5.x): hand it a copy
            model.save_pretrained(tmp, state_dict=dict(state), safe_serialization=True)
            copy_non_weight_files(self.model_path, tmp)
            logger.info("exported step %d to %s", self.step, out)

        run_on_main(info, lambda: write_dir_atomic(out, fill), what=f"export to {out}")
        return out

    def _export_adapter(self, out: Path, merged: bool, info: DistInfo) -> Path:
        tensors, config = self.adapter_tensors(), self.adapter_config()

        def fill(tmp: Path) -> None:
            lora.write_adapter(tmp, config, tensors)
            copy_non_weight_files(self.model_path, tmp)
            if merged:
                lora.write_merged(tmp / "merged", self.model_path, tmp)
                copy_non_weight_files(self.model_path, tmp / "merged")
            logger.info("exported the adapter of step %d to %s%s", self.step, out, " (and merged/)" if merged else "")

        run_on_main(info, lambda: write_dir_atomic(out, fill), what=f"adapter export to {out}")
        return out

    def export_weights(self, out_dir: str | Path) -> Path:
        """Write only the weights, as one ``model.safetensors`` in ``out_dir``: what a server's
        ``/update_weights_from_disk`` reads (SGLang's loader globs ``*.safetensors`` and reads no config or
        tokenizer file there). About a tenth of ``export_hf``'s time on a small model: no ``save_pretrained``
        (config, generation config, its own tensor handling) and no tokenizer files. The names and tensors are
        ``export_hf``'s (tied duplicates dropped); written into place as ``export_hf`` does. Collective.

        With LoRA: the adapter in PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``), what
        ``/load_lora_adapter``'s ``lora_path`` reads; no tokenizer files (SGLang would read an
        ``added_tokens.json`` there as the adapter's own tokens).
        """
        from safetensors.torch import save_file

        model, info = self.require_setup()
        out = Path(out_dir)
        if self.lora:
            tensors, config = self.adapter_tensors(), self.adapter_config()
            fill_adapter = lambda tmp: lora.write_adapter(tmp, config, tensors)  # noqa: E731
            run_on_main(info, lambda: write_dir_atomic(out, fill_adapter), what=f"adapter export to {out}")
            return out
        state = _drop_tied_duplicates(model, self.full_state_dict())

        def fill(tmp: Path) -> None:
            # no fsync, as save_pretrained does none: the servers read it back through the same page cache
            save_file(state, tmp / WEIGHTS_FILE, metadata={"format": "pt"})

        run_on_main(info, lambda: write_dir_atomic(out, fill), what=f"weights export to {out}")
        return out


def _shards(world_size: int, mp_policy) -> bool:
    """Whether FSDP2 wraps the model: with more than one rank to shard over, or to compute in bfloat16 from
    float32 master weights (its mixed-precision policy), even on one rank."""
    return world_size > 1 or mp_policy.param_dtype is not None


def _sum_gradients_over_ranks(model: nn.Module) -> None:
    """Make FSDP2's gradient reduce-scatter a SUM over ranks instead of its default mean.

    Each rank's loss is already divided by the GLOBAL normaliser (all ranks' loss tokens or sequences),
    so the gradient of the global batch is the sum of the ranks' gradients; FSDP2's default would divide
    it by the world size once more. Dividing by 1 with sum-only collectives (no NCCL PreMulSum, which
    gloo lacks) keeps the gradient exact on both backends and leaves the loss itself unscaled.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def run_on_main(info: DistInfo, fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on rank 0 while the others wait; every rank raises if it failed there. Collective.

    The others learn the outcome from a MIN all-reduce on the meta group rather than a bare barrier,
    so a failure on rank 0 becomes an error on every rank instead of a rank waiting for the timeout.
    """
    ok = torch.ones(1, dtype=torch.long)
    error: BaseException | None = None
    if info.is_main:
        try:
            fn()
        except BaseException as exc:  # re-raised below, after the others have been told
            ok.zero_()
            error = exc
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=info.meta_group)
    if error is not None:
        raise error
    if not ok.item():
        raise RuntimeError(f"{what} failed on rank 0; see rank 0's log for the cause")


def _drop_tied_duplicates(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Keep one name of each tied parameter (e.g. embed_tokens, not also lm_head), as Hugging Face saves them.

    The gathered state dict holds a separate copy under each name, so save_pretrained cannot see the tie.
    """
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first_name.setdefault(id(param), name) != name:
            state.pop(name, None)
    return state


def copy_non_weight_files(src: Path, dst: Path) -> None:
    """Copy tokenizer files, chat templates and custom code from the source model directory."""
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and path.name not in _WRITTEN_BY_SAVE:
            shutil.copy2(path, dst / path.name)

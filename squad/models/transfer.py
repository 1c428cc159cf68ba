"""Weight transfer from a dense ViT into any SquadViT (sparse upcycling; Komatsuzaki et al. 2023), in memory: the
maps behind `squad.upcycle` and training's ``train.init`` (`initialize_from`). Reading the files they start from is
`squad.io.weights`'s.

``transfer(dense, target)`` fills a built model from a dense `SquadViT` (`dense_from_timm_state` makes one of a timm
ViT state dict). Block ``i`` of the target comes from dense block ``i``; what goes where:

Shared parts (copied, shapes checked)
    patch embedding, class token, position embedding, every block's norms, dense attention and dense MLP (also inside
    MoD blocks, and MoNE blocks, whose nested experts are slices of the dense weights), the final norm. A timm ViT
    made for another image size (e.g. 224 px into a 64 px config) gets its position grid resampled (bicubic, as timm
    does); the "dense model" every step-0 figure compares with is then the ViT with that resampled grid.

MoE MLP (E experts of hidden width h, top-k; dense MLP of hidden width H). Every expert's output is multiplied by a
gate compensation ``c = 1 / (k·ḡ)``, ḡ being the gate a token's k experts get when the router is undecided
(uniform probabilities): ``ḡ = 1/k`` with renormalised gates (``model.moe.router.renormalize: true``, so ``c = 1``),
``ḡ = 1/(E + no-op experts)`` without (``c = (E + no-op)/k``). ``c`` scales the second layer (weights and bias).

- ``copy`` (h >= H): every expert is the dense MLP; the h - H extra hidden units keep their fresh first layer and
  get a zero second layer (they add nothing until trained). The token's output is ``Σ_j g_j·c·MLP(x)``: EXACTLY the
  dense MLP for any routing when the gates sum to 1 — renormalised gates, no no-op experts, no capacity dropping —
  in training (noise included) as in evaluation. Without renormalisation it is exact only while the router's
  probabilities are uniform (zero-initialised routers in evaluation); otherwise each token's MLP output is scaled by
  ``c·Σ_j g_j`` (close to 1 for fresh routers).
- ``partition`` (h < H, e.g. the paper's h = 4D/k): the H hidden units are cut into G = ceil(H/h) slices of h units;
  expert e holds slice e mod G, its second layer scaled by ``c·G`` (the dense bias ``c·b2`` on every expert). With
  equal gates a token gets ``(G/k)·Σ_j slice_j(x) + b2``: the dense MLP exactly when its k experts hold k distinct
  slices and G = k (the default width), and an unbiased estimate of it when the slices are drawn at random. Not
  exact for a learned routing: measure the drift (`drift`, tools/upcycle.py prints it).
- ``auto`` (default): ``copy`` when h >= H, else ``partition``.

MoE attention (E experts of head width d, top-k, one shared K/V head; dense attention with h heads of width d).
Expert e is dense head ``e mod h``: its query projection ``W_q^{e mod h}`` (the query bias has no place in MoA and
is dropped) and its output projection scaled by ``h / (k·ḡ)`` (``ḡ`` as above, so a token with equal gates gets
its k heads' outputs summed and rescaled to h heads). The output bias is the dense one. The shared key/value head:

- ``kv="mean"`` (default): the mean over the h dense heads of the key and of the value projections (weights and
  biases), as in GQA's multi-head → multi-query conversion (Ainslie et al. 2023, mean-pooling beats choosing a head).
- ``kv="first"``: dense head 0's key and value projections.

MoA is never exact (h heads with their own keys and values cannot be one shared K/V head); with k = h = E and
renormalised gates the only difference left is the shared K/V. `drift` measures how far the step-0 function is
(relative error of each block's output and of the final features; tools/upcycle.py prints it on random images).

Fresh (the run's init): routers (MoE, MoA, MoD, MoNE), MoNE's α, and heads that ``dense`` does not have with the
same name and shapes (a squad source's heads are copied by name; a timm classifier never is). Task embeddings: a
squad source's are copied by task name when both models add them the same way; otherwise (and for tasks the source
lacks) ``task_embed="zero"`` (default) starts them at zero — the dense model had none, so this keeps step 0 exact —
and ``task_embed="fresh"`` keeps the model's random init.

Dense parts the new model has no place for (a block with ``attn: none`` or ``mlp: none``) are dropped and reported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import torch
import torch.nn as nn

from squad.config.base import to_dict
from squad.config.loading import load_config
from squad.config.model import ModelConfig, SquadConfig
from squad.layers.attention import Attention
from squad.layers.block import Block
from squad.layers.mlp import Mlp
from squad.layers.mod import MoDBlock
from squad.layers.moe_attention import MoEAttention
from squad.layers.moe_mlp import MoEMlp
from squad.layers.mone import MoNEBlock
from squad.models.timm import load_timm_weights
from squad.models.vit import SquadViT, build_model

MoEScheme = Literal["auto", "copy", "partition"]
KVScheme = Literal["mean", "first"]
TaskEmbedInit = Literal["zero", "fresh"]

_TIMM_KEYS = ("patch_embed.proj.weight", "pos_embed", "blocks.0.attn.qkv.weight")


# ------------------------------------------------------------------------------------------------------ sources
def check_dense(model: SquadViT, source: str = "the dense model") -> None:
    """Raises ValueError unless every block of ``model`` is dense attention + dense MLP (no MoE, MoD, MoNE)."""
    for i, block in enumerate(model.blocks):
        if not isinstance(block, Block) or not isinstance(block.attn, Attention) or not isinstance(block.mlp, Mlp):
            spec = model.cfg.blocks()[i]
            raise ValueError(f"{source}: block {i} is not dense ({spec}); upcycling starts from a dense ViT (every "
                             f"block attn=dense, mlp=dense, no mod/mone)")


def _looks_like_timm(state: object) -> bool:
    return isinstance(state, Mapping) and all(isinstance(state.get(k), torch.Tensor) for k in _TIMM_KEYS)


def dense_from_timm_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig, source: str = "timm weights"
                          ) -> SquadViT:
    """A dense SquadViT holding a timm ViT state dict, with ``cfg``'s widths and heads (heads left fresh).

    The architecture is read from the weights; what the weights cannot tell (the number of heads) comes from ``cfg``.
    Everything that differs from ``cfg`` is refused naming the tensor, both shapes and the config key.

    Raises:
        ValueError: not a timm ViT state dict, or weights that do not fit ``cfg``.
    """
    if not _looks_like_timm(state):
        have = ", ".join(list(state)[:5]) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{source}: not a timm VisionTransformer state dict (it needs {', '.join(_TIMM_KEYS)}; it "
                         f"holds {have}...)")
    w = state["patch_embed.proj.weight"]
    pos = state["pos_embed"]
    qkv = state["blocks.0.attn.qkv.weight"]
    if w.ndim != 4 or pos.ndim != 3 or qkv.ndim != 2:
        raise ValueError(f"{source}: patch_embed.proj.weight {list(w.shape)} / pos_embed {list(pos.shape)} are not a "
                         f"timm ViT's [D, C, p, p] / [1, N, D]")
    dim, chans, patch = int(w.shape[0]), int(w.shape[1]), int(w.shape[2])
    depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks.") and k.split(".")[1].isdigit())
    class_token = "cls_token" in state
    checks = [("model.embed_dim", dim, cfg.embed_dim, "patch_embed.proj.weight", list(w.shape)),
              ("model.in_chans", chans, cfg.in_chans, "patch_embed.proj.weight", list(w.shape)),
              ("model.patch_size", patch, cfg.patch_size, "patch_embed.proj.weight", list(w.shape)),
              ("model.depth", depth, cfg.depth, "blocks.*", f"{depth} blocks"),
              ("model.class_token", class_token, cfg.class_token, "cls_token", "present" if class_token else "absent")]
    for key, found, want, tensor, shape in checks:
        if found != want:
            what = {"model.depth": f"{found} blocks, the config has model.depth={want}"}.get(
                key, f"the file's {key.removeprefix('model.')} is {found}, the config has {key}={want}")
            raise ValueError(f"{source}: {tensor} {shape} does not fit the config: {what}")
    grid = math.isqrt(pos.shape[1] - int(class_token))
    if grid * grid != pos.shape[1] - int(class_token) or pos.shape[2] != dim:
        raise ValueError(f"{source}: pos_embed {list(pos.shape)} is not a square grid of {dim}-wide position "
                         f"embeddings{' after the class token' if class_token else ''}")
    resampled = None
    if grid != cfg.grid:  # another image size: the position grid is resampled, as timm does
        state = {**state, "pos_embed": resample_pos_embed(pos, cfg.grid, int(class_token))}
        resampled = f"{grid}x{grid} -> {cfg.grid}x{cfg.grid} (bicubic)"
    inner = qkv.shape[0] // 3
    if inner % cfg.num_heads:
        raise ValueError(f"{source}: blocks.0.attn.qkv.weight {list(qkv.shape)}: its {inner} query features do not "
                         f"split into model.num_heads={cfg.num_heads} heads")
    final_norm = "norm.weight" in state
    if final_norm != cfg.final_norm:
        raise ValueError(f"{source}: the ViT {'has' if final_norm else 'has no'} final norm (norm.weight) but the "
                         f"config has model.final_norm={str(cfg.final_norm).lower()}"
                         + (" (an average-pooled ViT: set model.final_norm=false)" if not final_norm else ""))
    data = to_dict(cfg)
    fc1 = state.get("blocks.0.mlp.fc1.weight")
    data.update(plan=[{"attn": "dense", "mlp": "dense"}], task_embed="none", head_dim=inner // cfg.num_heads,
                qkv_bias="blocks.0.attn.qkv.bias" in state,
                mlp_ratio=(fc1.shape[0] / dim) if isinstance(fc1, torch.Tensor) else cfg.mlp_ratio)
    dense = build_model(load_config({"model": data}, cls=SquadConfig).model)
    try:
        missing = load_timm_weights(dense, dict(state), head=None)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"{source}: {str(e).splitlines()[0]}") from e
    lacking = [k for k in missing if not k.startswith("heads.")]
    if lacking:
        raise ValueError(f"{source}: the timm state dict lacks {', '.join(lacking[:3])}"
                         + (f" (and {len(lacking) - 3} more)" if len(lacking) > 3 else ""))
    dense.meta = {"format": "timm", "path": source, "pos_embed_resampled": resampled}
    return dense.eval()


def resample_pos_embed(pos: torch.Tensor, grid: int, prefix: int) -> torch.Tensor:
    """Position embeddings [1, prefix + g·g, D] resampled to a grid×grid patch grid (bicubic, antialiased, as timm's
    ``resample_abs_pos_embed`` does; the class token's embedding is kept as it is)."""
    head, body = pos[:, :prefix], pos[:, prefix:]
    g = math.isqrt(body.shape[1])
    img = body.reshape(1, g, g, -1).permute(0, 3, 1, 2).float()
    out = torch.nn.functional.interpolate(img, size=(grid, grid), mode="bicubic", align_corners=False,
                                          antialias=True)
    return torch.cat([head, out.permute(0, 2, 3, 1).reshape(1, grid * grid, -1).to(pos.dtype)], dim=1)


def dense_source(dense: SquadViT | nn.Module | Mapping, cfg: ModelConfig) -> tuple[SquadViT, bool]:
    """An in-memory dense source as a SquadViT, and whether its heads may be copied (a squad model's: yes; timm's: no).

    Args:
        dense: a dense `SquadViT`, a timm VisionTransformer module, or a timm state dict.
        cfg: the target's config (what a timm state dict cannot tell, the number of heads, comes from it).

    Raises:
        ValueError: a model that is not dense, or timm weights that do not fit ``cfg``.
        TypeError: none of these.
    """
    if isinstance(dense, SquadViT):
        check_dense(dense)
        return dense, True
    if isinstance(dense, Mapping):
        return dense_from_timm_state(dense, cfg), False
    if isinstance(dense, nn.Module):  # a timm VisionTransformer
        return dense_from_timm_state(dense.state_dict(), cfg, type(dense).__name__), False
    raise TypeError(f"upcycle: dense must be a SquadViT, a timm ViT (module or state dict) or a path, "
                    f"got {type(dense).__name__}")


# ------------------------------------------------------------------------------------------------------ schemes
def _gate_scale(router_cfg, top_k: int, choices: int) -> float:
    """c = 1 / (k·ḡ): 1 with renormalised gates, choices / k without (ḡ = 1/choices when probabilities are uniform)."""
    return 1.0 if router_cfg.renormalize else choices / top_k


@torch.no_grad()
def upcycle_mlp(moe: MoEMlp, mlp: Mlp, scheme: MoEScheme = "auto") -> dict:
    """Fills ``moe``'s experts from the dense ``mlp`` (module docstring: ``copy`` / ``partition``).

    Returns:
        What was done: ``scheme``, ``gate_scale``, ``exact`` (True when the layer equals the dense MLP for any
        routing) and ``why`` (what makes it inexact).
    """
    ex = moe.experts
    e, _, h = ex.w1.shape
    big_h = mlp.fc1.out_features
    cfg = moe.cfg
    if scheme == "auto":
        scheme = "copy" if h >= big_h else "partition"
    if scheme not in ("copy", "partition"):
        raise ValueError(f"MoE scheme must be auto, copy or partition, got {scheme!r}")
    if scheme == "copy" and h < big_h:
        raise ValueError(f"{moe.layer_name}: the copy scheme needs experts at least as wide as the dense MLP "
                         f"(model.moe.hidden={h} < the dense hidden width {big_h}); set model.moe.hidden={big_h} or "
                         f"use the partition scheme")
    c = _gate_scale(cfg.router, cfg.top_k, cfg.num_experts + cfg.noop_experts)
    w1, b1 = mlp.fc1.weight.t(), mlp.fc1.bias  # [D, H], [H]
    w2, b2 = mlp.fc2.weight.t(), mlp.fc2.bias  # [H, D], [D]
    groups = 1 if scheme == "copy" else math.ceil(big_h / h)
    width = big_h if scheme == "copy" else h
    for j in range(e):
        s = j % groups
        lo, hi = s * width, min((s + 1) * width, big_h)
        n = hi - lo
        ex.w1[j, :, :n] = w1[:, lo:hi]  # units n..h keep their fresh first layer
        ex.w2[j, :n] = w2[lo:hi] * (c * groups)
        ex.w2[j, n:] = 0
        if ex.b1 is not None:
            ex.b1[j, :n] = b1[lo:hi]
            ex.b1[j, n:] = 0
        if ex.b2 is not None:
            ex.b2[j] = b2 * c
    why = []
    if scheme == "partition":
        why.append(f"partition: {groups} slices of {h} hidden units, a token sees k={cfg.top_k} of them")
        if e < groups:
            why.append(f"only {e} of the {groups} slices have an expert")
    if not cfg.router.renormalize:
        why.append("gates are not renormalised (model.moe.router.renormalize=false): exact only while router "
                   "probabilities are uniform")
    if cfg.noop_experts:
        why.append("no-op experts take part of the gate mass")
    if cfg.capacity_factor > 0:
        why.append("capacity dropping")
    if ex.b1 is None and bool(b1.abs().max() > 0) or ex.b2 is None and bool(b2.abs().max() > 0):
        why.append("the experts have no biases (model.moe.bias=false): the dense biases are dropped")
    return {"kind": "moe", "scheme": scheme, "gate_scale": c, "exact": not why, "why": why}


@torch.no_grad()
def upcycle_attention(moa: MoEAttention, attn: Attention, kv: KVScheme = "mean") -> dict:
    """Fills ``moa``'s experts and shared K/V head from the dense ``attn`` (module docstring).

    Returns:
        ``scheme`` (the K/V choice), ``heads`` (dense head of each expert), ``o_scale``, ``exact`` (False but for a
        one-head dense attention) and ``why``.
    """
    if kv not in ("mean", "first"):
        raise ValueError(f"MoA key/value scheme must be mean or first, got {kv!r}")
    h, d = attn.num_heads, attn.head_dim
    if d != moa.head_dim:
        raise ValueError(f"{moa.layer_name}: the dense heads are {d} wide (attn.qkv.weight "
                         f"{list(attn.qkv.weight.shape)} = 3 × {h} heads × {d}) but model.moa.head_dim={moa.head_dim}; "
                         f"set model.moa.head_dim={d}")
    cfg = moa.cfg
    c = _gate_scale(cfg.router, cfg.top_k, cfg.num_experts)
    o_scale = h * c  # h / (k·ḡ): k heads with gates ḡ stand for the h dense heads
    w = attn.qkv.weight.view(3, h, d, -1)  # [q/k/v, head, d, D]
    b = attn.qkv.bias.view(3, h, d) if attn.qkv.bias is not None else None
    proj = attn.proj.weight.view(-1, h, d)  # [D, head, d]
    heads = [j % h for j in range(moa.num_experts)]
    for j, head in enumerate(heads):
        moa.q[j] = w[0, head].t()
        moa.o[j] = proj[:, head].t() * o_scale
    pick = (lambda t: t.mean(0)) if kv == "mean" else (lambda t: t[0])
    moa.kv.weight.copy_(torch.cat([pick(w[1]), pick(w[2])]))
    if moa.kv.bias is not None:
        moa.kv.bias.copy_(torch.cat([pick(b[1]), pick(b[2])]) if b is not None else torch.zeros_like(moa.kv.bias))
    moa.proj_bias.copy_(attn.proj.bias)
    why = []
    if h > 1:
        why.append(f"{h} dense key/value heads become one ({kv})")
    if b is not None and bool(b[0].abs().max() > 0):
        why.append("the query bias is dropped (MoA queries have none)")
    if b is not None and moa.kv.bias is None and bool(b[1:].abs().max() > 0):
        why.append("the key/value biases are dropped (model.qkv_bias=false)")
    if cfg.top_k != h or not cfg.router.renormalize:
        why.append(f"a token's k={cfg.top_k} gated heads stand for the {h} dense heads (output scaled by {o_scale:g})")
    return {"kind": "moa", "scheme": kv, "heads": heads, "o_scale": o_scale, "exact": not why, "why": why}


# ---------------------------------------------------------------------------------------------------- transfer
def _dense_key(key: str, target: SquadViT) -> str:
    """A target key as the dense model names it (MoD-wrapped blocks drop their ``.block``)."""
    parts = key.split(".")
    if parts[0] == "blocks" and len(parts) > 2 and parts[2] == "block" and isinstance(target.blocks[int(parts[1])],
                                                                                       MoDBlock):
        return ".".join(parts[:2] + parts[3:])
    return key


def _inner(block: nn.Module) -> nn.Module:
    return block.block if isinstance(block, MoDBlock) else block


@torch.no_grad()
def transfer(source: SquadViT, target: SquadViT, *, moe: MoEScheme = "auto", kv: KVScheme = "mean",
             task_embed: TaskEmbedInit = "zero", copy_heads: bool = True, source_name: str = "the dense model") -> dict:
    """Fills ``target`` (in place) from the dense ``source``; what is not filled keeps ``target``'s own init.

    Args:
        source: a dense SquadViT (`check_dense`).
        target: the model to fill, of the same widths, depth and tokens.
        moe, kv, task_embed: the schemes (module docstring).
        copy_heads: copy heads of the same name and shapes (False for a timm source, whose heads are placeholders).
        source_name: how errors name the source (its file).

    Returns:
        The report: ``layers`` (routed layer → what `upcycle_mlp` / `upcycle_attention` returned), ``dropped``
        (dense parts with no place), ``fresh`` (target parameters left at their init), ``heads_copied``,
        ``task_embed`` and ``exact`` (whether the step-0 function equals the dense one for any routing).

    Raises:
        ValueError: the source is not dense, its depth differs, or a tensor's shape differs (naming it and both
            shapes).
    """
    check_dense(source, source_name)
    if task_embed not in ("zero", "fresh"):
        raise ValueError(f"task_embed must be zero or fresh, got {task_embed!r}")
    if len(source.blocks) != len(target.blocks):
        raise ValueError(f"{source_name}: {len(source.blocks)} blocks, the config has model.depth="
                         f"{len(target.blocks)}")
    src = source.state_dict()
    own = target.state_dict()
    filled: set[str] = set()
    layers: dict[str, dict] = {}
    dropped: list[str] = []
    for i, (sb, tb) in enumerate(zip(source.blocks, target.blocks, strict=True)):
        inner = _inner(tb)
        prefix = f"blocks.{i}.block." if isinstance(tb, MoDBlock) else f"blocks.{i}."
        if isinstance(tb, MoNEBlock):
            continue  # MoNE's nested experts are the dense weights under their dense names: copied below
        for part, dense_part in (("attn", sb.attn), ("mlp", sb.mlp)):
            mod = getattr(inner, part)
            if mod is None:
                dropped.append(f"blocks.{i}.{part}")
            elif isinstance(mod, MoEMlp):
                layers[mod.layer_name] = upcycle_mlp(mod, dense_part, moe)
            elif isinstance(mod, MoEAttention):
                layers[mod.layer_name] = upcycle_attention(mod, dense_part, kv)
            else:
                continue
            filled.update(k for k in own if k.startswith(f"{prefix}{part}.") and ".router." not in k)
    for key, value in own.items():
        if key in filled or key.startswith(("heads.", "task_embed")):
            continue
        name = _dense_key(key, target)
        if name not in src:
            continue
        if src[name].shape != value.shape:
            hint = ""
            if ".attn." in name:
                hint = (f" (dense attention is model.num_heads={target.cfg.num_heads} heads of model.head_dim="
                        f"{target.cfg.head_dim or target.cfg.embed_dim // target.cfg.num_heads}; the file's heads are "
                        f"{source.cfg.head_dim or source.cfg.embed_dim // source.cfg.num_heads} wide: set "
                        f"model.head_dim to that, or null for embed_dim / num_heads)")
            elif ".mlp." in name:
                hint = f" (the file's MLP is {source.cfg.mlp_ratio:g} × embed_dim wide: set model.mlp_ratio)"
            where = "" if key == name else f" for {key}"
            raise ValueError(f"{source_name}: {name} has shape {list(src[name].shape)} but the config's model needs "
                             f"{list(value.shape)}{where}{hint}")
        value.copy_(src[name])
        filled.add(key)
    heads_copied = []
    if copy_heads:
        for name, head in target.heads.items():
            if name not in source.heads:
                continue
            a, b = source.heads[name].state_dict(), head.state_dict()
            if a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a):
                for k in b:
                    b[k].copy_(a[k])
                filled.update(f"heads.{name}.{k}" for k in b)
                heads_copied.append(name)
    embed = _init_task_embed(source, target, task_embed)
    if target.task_embed is not None:
        filled.add("task_embed")
    fresh = sorted(k for k in own if k not in filled)
    exact = (all(r["exact"] for r in layers.values()) and not dropped
             and embed in ("none", "zero", "copied") and not any(isinstance(b, MoNEBlock | MoDBlock)
                                                                 for b in target.blocks))
    return {"source": source_name, "pos_embed_resampled": getattr(source, "meta", {}).get("pos_embed_resampled"),
            "layers": layers, "dropped": dropped, "fresh": fresh,
            "heads_copied": heads_copied, "task_embed": embed, "exact": bool(exact)}


def _init_task_embed(source: SquadViT, target: SquadViT, how: TaskEmbedInit) -> str:
    """Target task embeddings: the source's rows by task name when both add them the same way, else zero/fresh."""
    if target.task_embed is None:
        return "none"
    same = source.task_embed is not None and source.cfg.task_embed == target.cfg.task_embed
    rows = source.task_embeddings() if same else None
    missing = []
    for t, name in enumerate(target.task_names):
        if same and name in source.task_names:
            target.task_embed[t] = rows[source.task_names.index(name)]
        else:
            missing.append(name)
            if how == "zero":
                target.task_embed[t] = 0
    if not same:
        return how
    return "copied" if not missing else f"copied where the source has the task, {how} for {', '.join(missing)}"


# ------------------------------------------------------------------------------------------------ init of a run
@torch.no_grad()
def initialize_from(model: SquadViT, source: SquadViT | Mapping, name: str, key: str = "train.init") -> dict:
    """Fills a freshly built ``model`` (in place) from an init source: what training's ``train.init`` does.

    Args:
        model: the run's model, freshly built.
        source: a squad model (`squad.io.weights.read_init_source` loads one from a file): of the same architecture
            and tasks (what tools/upcycle.py writes: every tensor must match by name and shape), or dense (another
            plan), which is upcycled into ``model`` with the default schemes (routers keep ``model``'s own init); or
            a timm ViT state dict, upcycled likewise.
        name: how messages name the source (its file).
        key: the config key the source came from (for messages).

    Returns:
        A short report: ``path``, ``how`` (``"loaded"`` or ``"upcycled"``), ``fresh`` (parameters left at init).

    Raises:
        ValueError: an extracted single-task model, or a source that does not fit ``model`` (naming the tensor and
            both shapes).
    """
    if isinstance(source, SquadViT):
        if _is_dense(source) and source.state_dict().keys() != model.state_dict().keys():
            report = transfer(source, model, source_name=name)
            return {"path": name, "how": "upcycled", "fresh": report["fresh"]}
        _load_same(source, model, f"{key}: {name}")
        return {"path": name, "how": "loaded", "fresh": []}
    if isinstance(source, nn.Module):
        raise ValueError(f"{key}: {name} is an extracted single-task model; it cannot initialise a full model")
    dense, _ = dense_source(source, model.cfg)
    report = transfer(dense, model, copy_heads=False, source_name=name)
    return {"path": name, "how": "upcycled", "fresh": report["fresh"]}


def _is_dense(model: SquadViT) -> bool:
    try:
        check_dense(model)
    except ValueError:
        return False
    return True


def _load_same(source: SquadViT, target: SquadViT, name: str) -> None:
    """Copies every tensor of a model with the same architecture and tasks (names and shapes checked)."""
    if source.task_names != target.task_names:
        raise ValueError(f"{name}: its tasks {source.task_names} differ from the run's model.heads "
                         f"{target.task_names} (per-task router rows, embeddings and heads would not line up); build "
                         f"the init file with the run's model config")
    src, own = source.state_dict(), target.state_dict()
    for key, value in own.items():
        if key not in src:
            raise ValueError(f"{name}: has no {key} (its model config differs from the run's: build the init file "
                             f"with the run's model config)")
        if src[key].shape != value.shape:
            raise ValueError(f"{name}: {key} has shape {list(src[key].shape)} but the run's model needs "
                             f"{list(value.shape)}")
        value.copy_(src[key])
    extra = sorted(set(src) - set(own))
    if extra:
        raise ValueError(f"{name}: {extra[0]} has no place in the run's model (its model config differs from the "
                         f"run's)")

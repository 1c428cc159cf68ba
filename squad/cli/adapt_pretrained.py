"""Turn a trained dense ViT into a Mixture-of-Depths model with no training, and compare the two routings.

    python tools/adapt_pretrained.py --checkpoint runs/dense/model.pt --capacity 0.5 --routing attention \\
        --data data/synthetic --out runs/dense/amod.pt
    python tools/adapt_pretrained.py --checkpoint vit_small.pth --num-heads 6 --capacity 0.5 --data data/synthetic \\
        --out amod.pt

The checkpoint is a squad model (``model.pt`` or a run folder) or a timm VisionTransformer state dict on disk
(.pth/.pt/.safetensors; architecture read from the weight shapes; a file with ``fc_norm`` is an average-pooled
ViT, its classifier on the mean patch token). The number of attention heads is not in the weights' shapes: it is
read from the file where it can be (a ``num_heads`` or a timm architecture name in the checkpoint or in a
``config.json`` beside it), else --num-heads must give it (exit 2 naming the flag; it is never
guessed). Every other block becomes a MoD block at --capacity. Both routings are evaluated on --data without any
training (A-MoD Table 3): task metrics for squad models, and for any model the agreement with the dense model
(top-1 of a class or token head, cosine of the final features; ``-`` where a measure does not apply). The model for
--routing is written to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path

from squad.cli import run
from squad.config.tools import AdaptConfig, defaults, from_namespace


def load_dense(path: str, num_heads: int | None):
    """A dense SquadViT from a squad model file/run folder or a timm state dict on disk."""
    import torch

    from squad import io
    from squad.config.loading import load_config
    from squad.io.hf_folder import resolve
    from squad.io.weights import read_weights, unwrap_state
    from squad.models.timm import load_timm_weights
    from squad.models.vit import build_model

    p = resolve(path)  # a hub id: its folder in huggingface_hub's cache
    if p.is_dir() or (p.suffix == ".pt" and _is_squad_file(p)):
        return io.load_model(p)
    if not p.is_file():
        raise FileNotFoundError(f"--checkpoint {p} not found (a squad model.pt / run folder, or a timm ViT state "
                                f"dict .pth/.pt/.safetensors)")
    try:
        outer = read_weights(p)
        state = dict(unwrap_state(outer))
    except (FileNotFoundError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 - pickle, zip and safetensors readers each raise their own kinds
        raise ValueError(f"{p}: not a readable model file: neither a squad model nor a timm ViT state dict "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    need = ("patch_embed.proj.weight", "pos_embed", "blocks.0.mlp.fc1.weight")
    if not isinstance(state, Mapping) or any(not isinstance(state.get(k), torch.Tensor) for k in need):
        have = f"keys {', '.join(list(state)[:5])}..." if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{p}: neither a squad model file nor a timm VisionTransformer state dict (it needs "
                         f"{', '.join(need)}; it holds {have})")
    w = state["patch_embed.proj.weight"]  # [D, C, p, p]
    if w.ndim != 4 or state["pos_embed"].ndim != 3:
        raise ValueError(f"{p}: patch_embed.proj.weight {tuple(w.shape)} / pos_embed {tuple(state['pos_embed'].shape)}"
                         f" are not a timm ViT's [D, C, p, p] / [1, N, D]")
    dim, chans, patch = w.shape[0], w.shape[1], w.shape[2]
    class_token = "cls_token" in state
    grid = int(round((state["pos_embed"].shape[1] - int(class_token)) ** 0.5))
    depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    heads = _num_heads(p, outer, dim, num_heads)
    final_norm = "norm.weight" in state  # an average-pooled ViT has none: its fc_norm comes after pooling
    data = {"img_size": grid * patch, "patch_size": patch, "in_chans": chans, "embed_dim": dim, "depth": depth,
            "num_heads": heads, "mlp_ratio": state["blocks.0.mlp.fc1.weight"].shape[0] / dim,
            "qkv_bias": "blocks.0.attn.qkv.bias" in state, "class_token": class_token, "final_norm": final_norm,
            "task_embed": "none", "plan": [{"attn": "dense", "mlp": "dense"}]}
    kind = None  # the squad head that equals the file's classifier, if any
    if "head.weight" in state:
        if "fc_norm.weight" in state:
            kind = "class"  # average pooling → fc_norm → head
        elif class_token and final_norm:
            kind = "token"  # norm → class token → head
    if kind is not None:
        data["heads"] = [{"name": "timm", "kind": kind, "channels": state["head.weight"].shape[0]}]
    else:
        data["heads"] = [{"name": "features", "kind": "class", "channels": 1}]
    model = build_model(load_config({"model": data}).model)
    try:
        load_timm_weights(model, state, head="timm" if kind is not None else None)
    except (KeyError, RuntimeError) as e:  # a tensor missing or of the wrong shape for the inferred architecture
        raise ValueError(f"{p}: the state dict does not fit the ViT its shapes describe ({_message(e)})") from e
    return model.eval()


def _num_heads(path: Path, outer: Mapping, dim: int, given: int | None) -> int:
    """The attention heads of a timm ViT file: what the file tells (`heads_in_file`), or ``--num-heads``, never a
    guess (a timm state dict does not store the head count, and ``D / 64`` is wrong for many ViTs).

    Raises:
        ValueError: the file does not tell and --num-heads is not given, --num-heads disagrees with the file, or
            it does not divide the width (exit 2, naming the flag).
    """
    known, how = heads_in_file(path, outer, dim)
    if given is not None:
        if given < 1 or dim % given:
            raise ValueError(f"--num-heads {given} does not divide the width {dim} of {path}")
        if known is not None and known != given:
            raise ValueError(f"--num-heads {given} disagrees with {path}, whose {how} gives {known} heads")
        return given
    if known is None:
        raise ValueError(f"{path}: the number of attention heads cannot be read from this file (a timm state dict "
                         f"does not store it; width {dim}): pass --num-heads (e.g. 6 for vit_small, 12 for "
                         f"vit_base: the model's num_heads)")
    return known


def heads_in_file(path: Path, outer: Mapping, dim: int) -> tuple[int | None, str]:
    """The head count a timm ViT file records, and where it was read; ``(None, "")`` when it records none.

    Read from a ``num_heads`` / ``model_args.num_heads`` entry beside the weights (a checkpoint dict) or in the
    ``config.json`` beside the file (the layout timm models have on model hubs), else from the timm architecture
    named there (``arch`` / ``architecture``, e.g. ``vit_small_patch16_224.augreg_in21k``), whose definition in the
    installed timm gives the count. The checkpoint is read first.

    Raises:
        ValueError: what the file records contradicts its weights (a width the heads do not divide, an architecture
            of another width, an unknown architecture).
    """
    records: list[tuple[Mapping, str]] = [(outer, "checkpoint")]
    config = path.parent / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except ValueError as e:
            raise ValueError(f"{config}: not valid JSON ({e})") from e
        if isinstance(data, Mapping):
            records.append((data, str(config)))
    for record, where in records:
        args = record.get("model_args") if isinstance(record.get("model_args"), Mapping) else {}
        for value in (record.get("num_heads"), args.get("num_heads")):
            if isinstance(value, int) and not isinstance(value, bool):
                if value < 1 or dim % value:
                    raise ValueError(f"{path}: {where} records num_heads={value}, which does not divide the width "
                                     f"{dim}")
                return value, f"{where}'s num_heads"
        arch = record.get("arch") or record.get("architecture")
        if isinstance(arch, str) and arch:
            return _timm_arch_heads(path, arch, dim), f"{where}'s architecture {arch}"
    return None, ""


def _timm_arch_heads(path: Path, arch: str, dim: int) -> int:
    """The head count of timm architecture ``arch`` (built on the meta device: no weights, no download)."""
    import timm
    import torch

    try:
        with torch.device("meta"):
            vit = timm.create_model(arch, pretrained=False)
    except Exception as e:  # noqa: BLE001 - timm raises RuntimeError / KeyError for unknown names
        raise ValueError(f"{path} names the timm architecture {arch!r}, which this timm ({timm.__version__}) does "
                         f"not know ({type(e).__name__}: {_message(e)}); pass --num-heads") from e
    blocks = getattr(vit, "blocks", None)
    attn = getattr(blocks[0], "attn", None) if blocks is not None and len(blocks) else None
    heads = getattr(attn, "num_heads", None)
    if not isinstance(heads, int) or getattr(vit, "embed_dim", None) != dim:
        raise ValueError(f"{path} names the timm architecture {arch!r} (width {getattr(vit, 'embed_dim', '?')}), "
                         f"but its weights are {dim} wide; pass --num-heads")
    return heads


def _message(e: BaseException) -> str:
    return e.args[0] if isinstance(e, KeyError) and e.args else str(e).splitlines()[0]


def _is_squad_file(p: Path) -> bool:
    from squad import io

    try:
        io.read_payload(p)
        return True
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/adapt_pretrained.py`` / ``squad-adapt-pretrained`` (defaults:
    `squad.config.tools.AdaptConfig`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="squad model.pt / run folder / Hugging Face-style folder or "
                    "hf-hub:ORG/NAME id, or a timm ViT state dict file")
    ap.add_argument("--capacity", type=float, help="share of tokens each MoD block processes (default 0.5)")
    ap.add_argument("--routing", choices=["attention", "learned"],
                    help="routing of the model written to --out (default attention; both are evaluated)")
    ap.add_argument("--every", type=int, help="MoD on every N-th block (default 2)")
    ap.add_argument("--data", help="Taskonomy-format data to evaluate on (e.g. data/synthetic)")
    ap.add_argument("--split", help="the split evaluated (default val)")
    ap.add_argument("--batches", type=int, help="evaluation batches (default 8; 0 = the whole split)")
    ap.add_argument("--batch-size", type=int, help="default 16")
    ap.add_argument("--num-heads", type=int, help="attention heads of a timm file (needed when the file does not "
                    "record them; checked against it when it does)")
    ap.add_argument("--out", required=True, help="where to write the adapted model (squad model file)")
    ap.set_defaults(**defaults(AdaptConfig))
    return ap


def _adapt(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    opts = from_namespace(AdaptConfig, args)  # checked before torch is imported
    import torch

    from squad import io
    from squad.io.files import atomic_write_text, check_writable
    from squad.posttrain.adapt import fidelity, to_mod

    check_writable(args.out, "--out")
    torch.manual_seed(0)
    dense = load_dense(args.checkpoint, opts.num_heads)
    models = {"dense": dense}
    for routing in ("attention", "learned"):
        models[routing] = to_mod(dense, opts.capacity, routing, opts.every).eval()

    rows = {name: {} for name in models}
    if opts.data:
        from squad.data import build_dataset, eval_loader
        from squad.eval.evaluate import evaluate, primary
        from squad.tasks import TASK_NAMES

        tasks = [t for t in dense.task_names if t in TASK_NAMES]
        ds = build_dataset(opts.data, tasks or ["depth_euclidean"], opts.split, image_size=dense.cfg.img_size)
        loader = eval_loader(ds, opts.batch_size)
        images = torch.cat([b["rgb"] for i, b in zip(range(opts.batches or 10**9), loader, strict=False)])
        probe = tasks[0] if tasks else dense.task_names[0]
        for name, m in models.items():
            if tasks:
                rows[name].update(primary(evaluate(m, loader, tasks, max_batches=opts.batches)))
            if name != "dense":  # agreement with the dense model (the reference: its own row has none)
                f = fidelity(m, dense, images, probe)
                rows[name]["feature_cosine"] = f.feature_cosine
                if not math.isnan(f.top1_agreement):  # a class or token head: top-1 is defined
                    rows[name]["top1_agreement"] = f.top1_agreement
    print(f"MoD adaptation of {args.checkpoint} ({dense.cfg.num_heads} heads of width "
          f"{dense.cfg.embed_dim // dense.cfg.num_heads}): capacity {opts.capacity}, every {opts.every} blocks, "
          f"no training")
    print(_table(rows))
    out = Path(args.out)
    chosen = models[opts.routing]
    io.export_model(out, chosen, None, {"adapted_from": str(args.checkpoint), "capacity": opts.capacity,
                                          "routing": opts.routing, "evaluation": rows})
    atomic_write_text(out.with_suffix(".json"), json.dumps({"capacity": opts.capacity, "every": opts.every,
                                                            "results": rows}, indent=2), "the evaluation")
    print(f"wrote {out} ({opts.routing} routing) and {out.with_suffix('.json')}")
    return 0


def _table(rows: dict[str, dict[str, float]]) -> str:
    """The summary: one row per model, one column per measure; ``-`` where a measure does not apply (the dense
    model is the reference of the agreement columns; top-1 needs a class head)."""
    keys = sorted({k for r in rows.values() for k in r})
    lines = [f"{'model':<10}" + "".join(f"{k[:18]:>20}" for k in keys)]
    for name, r in rows.items():
        lines.append(f"{name:<10}" + "".join(f"{r[k]:>20.4f}" if k in r else f"{'-':>20}" for k in keys))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Adapts a dense model to MoD and compares both routings; exit 2 on bad input (`squad.cli.run`)."""
    return run(_adapt, argv)


if __name__ == "__main__":
    sys.exit(main())

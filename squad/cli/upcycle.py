"""Turn a dense ViT into the initialisation of a Mod-Squad (or any squad model): sparse upcycling.

    python tools/upcycle.py --from vit_small.pth --config modsquad_vit_s --set head_dim=null --out init.pt
    python tools/upcycle.py --from runs/dense --config configs/taskonomy/modsquad_vit_s.yaml --out init.pt
    python tools/train.py --config configs/taskonomy/modsquad_vit_s.yaml --set train.init=init.pt --out runs/up

--from is a timm VisionTransformer state dict (.pth/.pt/.safetensors; the number of heads comes from the config) or
a dense squad model (model.pt, run folder or checkpoint). --config is a model or run config (a registered name or a
YAML file; --set changes its model keys, with or without the ``model.`` prefix); its widths, depth, patch and image
size must be the dense model's. The shared parts are copied, MoE-MLP experts and MoE-attention heads come from the
dense MLP and heads, routers are fresh (schemes and their step-0 accuracy: `squad.models.transfer`). The step-0
drift from the dense model (relative error of the final features and of each block's output) is measured on
--images random images and printed, and stored with the model. --out is a squad model file: `squad.load` opens it,
and a run starts from it with ``train.init``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from squad.cli import run
from squad.config.tools import UpcycleConfig, defaults, from_namespace


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/upcycle.py`` / ``squad-upcycle`` (defaults: `squad.config.tools.UpcycleConfig`)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", required=True, metavar="FILE",
                   help="timm ViT state dict (.pth/.pt/.safetensors) or dense squad model (model.pt / run folder)")
    p.add_argument("--config", required=True, help="model or run config of the new model (name or YAML file)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model key, e.g. --set moe.router.renormalize=true (repeatable)")
    p.add_argument("--out", required=True, help="the squad model file to write (e.g. init.pt)")
    p.add_argument("--moe-scheme", choices=["auto", "copy", "partition"],
                   help="MoE-MLP experts: copies of the dense MLP (exact with renormalised gates; needs "
                        "moe.hidden >= the dense hidden width), slices of its hidden units, or auto (default)")
    p.add_argument("--kv", choices=["mean", "first"],
                   help="MoE attention's shared key/value head: the mean of the dense heads' (default) or head 0's")
    p.add_argument("--task-embed", choices=["zero", "fresh"],
                   help="task embeddings the dense model lacks: zero (default, keeps step 0 exact) or random")
    p.add_argument("--seed", type=int, help="seed of the fresh parts (routers, new heads; default 0)")
    p.add_argument("--images", type=int, help="random images the step-0 drift is measured on (default 8; 0: none)")
    p.set_defaults(**defaults(UpcycleConfig))
    return p


def _upcycle(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    opts = from_namespace(UpcycleConfig, args)  # checked before torch is imported
    from squad.io.files import check_writable

    check_writable(args.out, "--out")  # before the models are built
    import torch

    from squad import io
    from squad.config.loading import model_config
    from squad.io.weights import read_dense_source
    from squad.models.transfer import transfer
    from squad.models.vit import build_model
    from squad.posttrain.upcycle import drift

    cfg = model_config(args.config, args.set)
    source = Path(args.source)
    torch.manual_seed(opts.seed)
    model = build_model(cfg).eval()  # the fresh parts: what a run seeded --seed would draw
    dense, copy_heads = read_dense_source(source, cfg)
    report = transfer(dense, model, moe=opts.moe_scheme, kv=opts.kv, task_embed=opts.task_embed,
                      copy_heads=copy_heads, source_name=str(source))
    print(f"upcycled {source} into {cfg.name} ({cfg.depth} blocks, {len(model.task_names)} tasks)")
    for layer, r in report["layers"].items():
        detail = f"gate scale {r['gate_scale']:g}" if r["kind"] == "moe" else f"output scale {r['o_scale']:g}"
        state = "exact" if r["exact"] else "approximate: " + "; ".join(r["why"])
        print(f"  {layer}: {r['kind']} {r['scheme']}, {detail}, {state}")
    if report["pos_embed_resampled"]:
        print(f"  position embeddings resampled: {report['pos_embed_resampled']}")
    if report["dropped"]:
        print(f"  dropped (no place in the new plan): {', '.join(report['dropped'])}")
    print(f"  task embeddings: {report['task_embed']}; heads copied: {', '.join(report['heads_copied']) or 'none'}")
    measured = None
    if opts.images:
        g = torch.Generator().manual_seed(opts.seed)
        images = torch.randn(opts.images, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g)
        measured = drift(model, dense, images)
        print(f"step-0 drift on {opts.images} random images (relative error vs the dense model): final features "
              f"{measured['max_features']:.3g}; per block " + ", ".join(f"{v:.3g}" for v in measured["blocks"]))
    out = Path(args.out)
    io.export_model(out, model, None, {"upcycled_from": str(source), "upcycle": _plain(report), "drift": measured,
                                       "schemes": {"moe": opts.moe_scheme, "kv": opts.kv,
                                                   "task_embed": opts.task_embed, "seed": opts.seed}})
    print(f"wrote {out}{' (exact at step 0)' if report['exact'] else ''}")
    return 0


def _plain(report: dict) -> dict:
    """The report as JSON-able plain data (what a weights_only load accepts)."""
    return json.loads(json.dumps(report))


def main(argv: list[str] | None = None) -> int:
    """Upcycles a dense ViT into a squad model file; exit 2 on bad input (`squad.cli.run`)."""
    return run(_upcycle, argv)


if __name__ == "__main__":
    sys.exit(main())

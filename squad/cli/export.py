"""Export a squad model as a torch.export program, an ONNX file or a Hugging Face-style folder.

The model may be a full one or an extracted single-task one.

The program (.pt2) runs with PyTorch alone, without squad; ``--format onnx`` writes an ONNX file for ONNX Runtime or
TensorRT; ``--format hf`` a folder with model.safetensors, config.json and a model card that ``squad.load`` opens
(``--push org/name`` uploads it to the hub); ``--format model.pt`` writes squad's model.pt from any checkpoint tag
(squad's counterpart of DeepSpeed's zero_to_fp32.py). --checkpoint also takes such a folder or a hub id
(hf-hub:org/name[@revision], through huggingface_hub's cache).

    python tools/export.py --checkpoint depth.pt --out depth.pt2                 # an extracted model (tools/extract.py)
    python tools/export.py --checkpoint runs/demo --out demo.pt2                 # a full model: every task
    python tools/export.py --checkpoint runs/demo --tasks depth,normal --out dn.pt2
    python tools/export.py --checkpoint runs/demo/checkpoints/step00000060 --format model.pt --out step60.pt
    python tools/export.py --checkpoint runs/demo --format onnx --out demo.onnx
    python tools/export.py --checkpoint runs/demo --format hf --out demo-hf [--push org/name]

--format pt2 (default): the program takes a float32 image batch [B, C, S, S] on the CPU (S = the model's img_size,
fixed; B any size unless --static-batch) and returns a dict task → prediction, what squad's model gives. Load it with
PyTorch alone:

    net = torch.export.load("depth.pt2").module();  preds = net(images)["depth_euclidean"]

Every layer kind exports (dense, MoE attention, MoE MLP, MoD, A-MoD, MoNE at --mone-capacity); MoD threshold
inference is refused (exit 2, saying why). After writing, the tool reloads the file and compares it with squad's own
outputs on random images (max |diff| per task printed; exit 1 if above 1e-4). The file is written atomically: an
--out that cannot be written is refused before the model is loaded (exit 2); a write that fails (a full disk, or
/dev/full) exits 3 naming the file and the free space, and leaves no partial file.

--format onnx: the same graph as the program (images [batch, C, S, S] float32 → one output per task, named after
it) through torch's dynamo exporter; every layer kind the program takes is expressed (MoD threshold inference is
refused, naming the block). The written file is run in ONNX Runtime (CPU) on --check-images random images and
compared with squad (exit 1 above 1e-4).

--format hf: a Hugging Face-style folder (squad.save_pretrained): model.safetensors (sharded past
--max-shard-size with the hub's index), config.json (model config, tasks, inference options, the kept experts of an
extracted model, squad's version) and README.md, a model card with the tasks, validation metrics, parameters and
MACs, routing figures and the training command of the run the checkpoint comes from. The folder is reloaded and
compared with squad (exit 1 unless equal). --push ORG/NAME uploads it with huggingface_hub (its login token).

--format model.pt: the model of any checkpoint tag (or run folder, or model.pt) as squad's model.pt: squad's
parameter names, every expert, the expert-usage statistics, the step; loadable with ``squad.load``. ZeRO-1/2 keep
the full module weights in every tag's model-states file, so nothing is merged; under bf16 training those are the
bf16 copies (as in the run's own model.pt). For the fp32 master weights of a bf16 or ZeRO run, run DeepSpeed's
script that such a run's checkpoints/ folder holds (an fp32 run at ZeRO stage 0 has none and needs none: its tags
hold the fp32 weights) and pass its output with --weights (the uncertainty weighting's task log-variances it also
holds go to the model.pt's extra.task_log_vars):

    python runs/x/checkpoints/zero_to_fp32.py runs/x/checkpoints runs/x/fp32      # the latest tag (-t TAG: another)
    python tools/export.py --checkpoint runs/x/checkpoints --format model.pt --weights runs/x/fp32 --out fp32.pt

An expert-parallel run's experts are not in DeepSpeed's files (zero_to_fp32.py writes the other weights): they come
from the tag's expert shard files, float32 master weights, put back together whatever expert-parallel size wrote them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from squad.cli import require_paths, run
from squad.cli.evaluate import add_inference_arguments, add_precision_argument
from squad.config.tools import InferenceOptions, from_namespace

TOLERANCE = 1e-4  # max |exported − squad| the check accepts (the programs are exact on the CPU: 0 in the tests)
BF16_TOLERANCE = 1e-2  # the same in bf16: the program's per-expert matmuls round unlike grouped ones (~1e-3)


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/export.py`` / ``squad-export``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="extracted model file, run folder, model.pt, checkpoint "
                   "tag (RUN/checkpoints/TAG; RUN/checkpoints = its latest complete tag), Hugging Face-style folder "
                   "or hub id hf-hub:ORG/NAME[@REVISION]")
    p.add_argument("--out", required=True, help="file to write (.pt2 for --format pt2, .onnx for onnx; a folder for "
                   "hf)")
    p.add_argument("--format", choices=["pt2", "onnx", "hf", "model.pt"], default="pt2",
                   help="pt2: a torch.export program (default); onnx: an ONNX file; hf: a Hugging Face-style folder "
                   "(safetensors + config.json + model card); model.pt: squad's model file (fp32 weights)")
    p.add_argument("--push", default=None, metavar="ORG/NAME", help="--format hf: upload the folder to this hub "
                   "repository (created if missing) with huggingface_hub")
    p.add_argument("--max-shard-size", type=int, default=None, metavar="BYTES", help="--format hf: bytes per "
                   "weights file before the weights are sharded (default 5e9, the hub's)")
    p.add_argument("--tasks", default=None, help="comma-separated tasks the program predicts (default: all of the "
                   "model's; an extracted model has one)")
    p.add_argument("--static-batch", type=int, default=None, metavar="B",
                   help="fix the program's batch size to B >= 2 (default: any batch size)")
    add_inference_arguments(p)
    p.add_argument("--weights", default=None, help="--format model.pt: take the weights from this state dict instead "
                   "(DeepSpeed's zero_to_fp32.py output: its file or folder; names with or without the 'model.' "
                   "prefix), e.g. the fp32 master weights of a bf16 ZeRO run")
    add_precision_argument(p, "fp32: the program runs on the CPU; bf16 halves it for a GPU")
    p.add_argument("--check-images", type=int, default=3, help="random images the written program is checked on "
                   "against squad (0: no check; default 3)")
    return p


def _export(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    suffix = Path(args.out).suffix.lower()
    meant = {".pt2": "pt2", ".onnx": "onnx", ".pt": "model.pt", ".safetensors": "hf"}.get(suffix)
    if meant is not None and meant != args.format:
        raise ValueError(f"--out {args.out} is a {suffix} file name but --format is {args.format}: pass --format "
                         f"{meant}" + (" (a folder: --out without .safetensors)" if meant == "hf" else "")
                         + f", or an --out ending as --format {args.format} writes")
    require_paths(args.checkpoint)  # before anything heavy is imported

    import torch

    import squad
    from squad.deploy.export import check_program, export_program, load_program, program_bytes, program_info
    from squad.io.files import atomic_write_bytes, check_writable
    from squad.models.inference import set_inference
    from squad.models.precision import precision_dtype

    if args.format != "hf":
        for flag in ("push", "max_shard_size"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} applies to --format hf only")
    out = check_writable(Path(args.out), "--out", folder=args.format == "hf")  # before the model is loaded
    model = squad.load(args.checkpoint)
    if args.format == "model.pt":
        return _write_model_pt(model, args, out)
    if args.format == "hf":
        return _write_folder(model, args, out)
    if args.static_batch is not None and args.static_batch < 2:
        raise ValueError(f"--static-batch must be >= 2 (torch.export fixes a traced size of 0 or 1), got "
                         f"{args.static_batch}")
    if args.check_images < 0:
        raise ValueError(f"--check-images must be >= 0, got {args.check_images}")
    set_inference(model, **dataclasses.asdict(from_namespace(InferenceOptions, args)))
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    if args.format == "onnx":
        return _write_onnx(model, args, out, tasks)
    dtype = precision_dtype(args.precision, "cpu")
    program = export_program(model, tasks, dynamic_batch=args.static_batch is None,
                             example_batch=args.static_batch or 2, dtype=dtype)
    data = program_bytes(program)
    atomic_write_bytes(out, data, "the exported program")
    info = program_info(program)
    print(f"program: {out} ({len(data) / 2**20:.1f} MiB)")
    print(f"input: images {info['input']} {info['dtype']} (CPU); output: dict of {', '.join(info['tasks'])}")
    if args.check_images == 0:
        return 0
    cfg = getattr(model, "model", model).cfg  # an extracted model's inner SquadViT
    b = args.static_batch or args.check_images
    images = torch.randn(b, cfg.in_chans, cfg.img_size, cfg.img_size, generator=torch.Generator().manual_seed(1))
    images = images.to(dtype)
    written = load_program(out if out.is_file() else data)  # the file itself (a device such as /dev/stdout: the bytes)
    diffs = check_program(written, model, images, info["tasks"])
    worst = max(diffs.values())
    tolerance = TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    print(f"check on {b} random images, max |program - squad|: "
          + ", ".join(f"{t} {d:.2e}" for t, d in diffs.items()))
    if worst > tolerance:
        print(f"error: the program differs from squad by {worst:.2e} (> {tolerance:g})", file=sys.stderr)
        return 1
    return 0


def _write_onnx(model, args: argparse.Namespace, out: Path, tasks: list[str] | None) -> int:
    """``--format onnx``: the ONNX file, then checked in ONNX Runtime against squad."""
    import torch

    from squad.deploy.onnx import check_onnx, export_onnx

    if args.static_batch is not None:
        raise ValueError("--static-batch applies to --format pt2 only (the ONNX file's batch is dynamic)")
    if args.precision not in (None, "fp32"):
        raise ValueError(f"--format onnx writes float32 (ONNX Runtime's CPU kernels); --precision {args.precision} "
                         f"applies to --format pt2")
    import onnx

    data = export_onnx(model, out, tasks)
    cfg = getattr(model, "model", model).cfg
    names = [o.name for o in onnx.load_from_string(data).graph.output]
    print(f"onnx: {out} ({len(data) / 2**20:.1f} MiB)")
    print(f"input: images [batch, {cfg.in_chans}, {cfg.img_size}, {cfg.img_size}] float32; outputs: "
          f"{', '.join(names)}")
    if args.check_images == 0:
        return 0
    images = torch.randn(args.check_images, cfg.in_chans, cfg.img_size, cfg.img_size,
                         generator=torch.Generator().manual_seed(1))
    diffs = check_onnx(out if out.is_file() else data, model, images)
    worst = max(diffs.values())
    print(f"check in ONNX Runtime on {args.check_images} random images, max |onnx - squad|: "
          + ", ".join(f"{t} {d:.2e}" for t, d in diffs.items()))
    if worst > TOLERANCE:
        print(f"error: the ONNX file differs from squad by {worst:.2e} (> {TOLERANCE:g})", file=sys.stderr)
        return 1
    return 0


def _write_folder(model, args: argparse.Namespace, out: Path) -> int:
    """``--format hf``: the Hugging Face-style folder, reloaded and compared; ``--push`` uploads it."""
    import torch

    import squad
    from squad.deploy.hf import push_to_hub, save_pretrained
    from squad.io.hf_folder import MAX_SHARD_SIZE
    from squad.models.inference import set_inference

    for flag in ("tasks", "static_batch", "precision", "weights"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} does not apply to --format hf (the folder holds the whole "
                             f"model in float32)")
    set_inference(model, **dataclasses.asdict(from_namespace(InferenceOptions, args)))
    save_pretrained(model, out, max_shard_size=args.max_shard_size or MAX_SHARD_SIZE)
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"folder: {out} ({len(files)} files, {size / 2**20:.1f} MiB: {', '.join(files)})")
    if args.check_images:
        cfg = getattr(model, "model", model).cfg
        images = torch.randn(args.check_images, cfg.in_chans, cfg.img_size, cfg.img_size,
                             generator=torch.Generator().manual_seed(1))
        again = squad.load(out)
        with torch.no_grad():
            want, got = model(images), again(images)
        want = getattr(want, "preds", want)
        got = getattr(got, "preds", got)
        pairs = [(t, want[t], got[t]) for t in want] if isinstance(want, dict) else [("output", want, got)]
        diffs = {t: float((a - b).abs().max()) for t, a, b in pairs}
        print("check: squad.load(folder) against the model, max |diff|: "
              + ", ".join(f"{t} {d:.2e}" for t, d in diffs.items()))
        if max(diffs.values()) > 0:
            print("error: the folder's model differs from the one written", file=sys.stderr)
            return 1
    if args.push:
        url = push_to_hub(out, args.push)
        print(f"pushed: {args.push} ({url}); load it with squad.load('hf-hub:{args.push}')")
    return 0


def _write_model_pt(model, args: argparse.Namespace, out: Path) -> int:
    """``--format model.pt``: the loaded full model written as squad's model.pt (fp32)."""
    from squad.io import export_model
    from squad.models.single_task import SingleTaskModel

    if isinstance(model, SingleTaskModel):
        raise ValueError(f"{args.checkpoint} is an extracted model file already (squad.load reads it); "
                         f"--format model.pt converts a checkpoint tag, run folder or model.pt")
    for flag in ("tasks", "static_batch", "mone_capacity", "mod_inference", "precision"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} applies to --format pt2 only")
    extra = dict(model.meta.get("extra") or {})
    extra["exported_from"] = str(model.meta.get("path", args.checkpoint))
    if args.weights is not None:
        model, log_vars = _with_weights(model, Path(args.weights))
        extra["weights_from"] = str(args.weights)
        if log_vars is not None:  # the fp32 master copy of the learned task weights
            extra["task_log_vars"] = log_vars
    export_model(out, model, model.usage, extra=extra)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {out} ({n:,} parameters, fp32; from {extra['exported_from']}, step {extra.get('step')})")
    return 0


# What the engine's module (squad's training objective, `squad.train.objective.MultiTaskObjective`) holds beside the
# model: the learned log-variances of uncertainty weighting (loss.weighting: uncertainty / uncertainty_log1p).
OBJECTIVE_TENSORS = ("weighting.log_vars",)


def _with_weights(model, source: Path):
    """``model`` with the weights of a state dict file or folder (zero_to_fp32.py's output), shape-checked, and the
    objective's task log-variances when the file has them (else None)."""
    import json

    import torch

    from squad.models.surgery import build_on_meta, load_assigned

    if source.is_dir():
        index = [source / n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                 if (source / n).is_file()]
        singles = [source / n for n in ("model.safetensors", "pytorch_model.bin") if (source / n).is_file()]
        if index:
            files = sorted({source / f for f in json.loads(index[0].read_text())["weight_map"].values()})
        elif singles:
            files = singles[:1]
        else:
            raise FileNotFoundError(f"--weights {source}: no model.safetensors, pytorch_model.bin or shard index "
                                    f"(the files zero_to_fp32.py writes)")
    elif source.is_file():
        files = [source]
    else:
        raise FileNotFoundError(f"--weights {source}: no such file or folder")
    state: dict = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(file))
            continue
        try:
            part = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling problem: not a plain state dict
            raise ValueError(f"--weights {file}: not a plain state dict ({type(e).__name__})") from e
        if not isinstance(part, dict):
            raise ValueError(f"--weights {file}: not a state dict (a {type(part).__name__})")
        state.update(part)
    # zero_to_fp32 names the engine's module: squad's training objective, whose model is "model." and whose task
    # weighting (uncertainty weighting's log-variances) is "weighting."
    log_vars = None
    if any(k.startswith("model.") for k in state):
        objective = {k: state.pop(k) for k in OBJECTIVE_TENSORS if k in state}
        others = [k for k in state if not k.startswith("model.")]
        if others:
            raise ValueError(f"--weights {source}: tensors that are neither the model's ('model.') nor the training "
                             f"objective's ({', '.join(OBJECTIVE_TENSORS)}): {', '.join(others[:5])}")
        if "weighting.log_vars" in objective:
            log_vars = objective["weighting.log_vars"].detach().float().cpu()
    state = {k.removeprefix("model."): v.detach().to(torch.float32) if v.is_floating_point() else v.detach()
             for k, v in state.items()}
    if model.meta.get("format") == "deepspeed-checkpoint":  # an expert-parallel run's experts are in its shard files
        from squad.io.expert_files import whole_experts

        for name, weight in whole_experts(model.meta["path"]).items():  # float32 master weights
            state.setdefault(name, weight)
    fresh = load_assigned(build_on_meta(model.cfg), state, str(source)).eval()
    fresh.usage, fresh.meta = model.usage, model.meta
    return fresh, log_vars


def main(argv: list[str] | None = None) -> int:
    """Exports a model as a .pt2 program or a model.pt; exit 2 on bad input or a model that cannot be exported."""
    return run(_export, argv)


if __name__ == "__main__":
    sys.exit(main())

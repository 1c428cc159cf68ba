"""The checkpointer: the one owner of a run's checkpoints — their layout, saving (on a cadence, at the end, when a
signal asks), resolving what a run resumes from, passing over a damaged tag, converting a tag written on another
topology, and loading it. The layout's names and the torch-free reading of it (markers, complete tags, which tag a
path names) are in `squad.io.checkpoints`, below this floor, so that `squad.load` reads tags without it.

Layout of ``<run>/checkpoints/``::

    step00000060/             a complete tag: DeepSpeed's files and COMPLETE
        mp_rank_00_model_states.pt                  module weights, lr schedule, squad's loop state (client state)
        [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   ZeRO's optimizer shard of data-parallel rank r
        [expert_shards_rank<i>.pt]                  the experts of an expert-parallel run (`squad.io.expert_files`)
        config.yaml                                 the resolved run config it was trained with (a resume compares it)
        COMPLETE                                    {"step", "world_size", "zero_stage", "expert_shards", "data": the
                                                    training data's sample count and fingerprint}: written last
    latest                    the newest complete tag (replaced atomically)
    .saving/step00000080/     a save in progress; renamed to step00000080/ once every rank has written and COMPLETE
                              is in, so a save that is killed at any moment never leaves a file in a tag folder (the
                              next start removes what it left)
    .convert/step00000060/    the tag converted for this run's topology (`CONVERSIONS`), removed once loaded
    zero_to_fp32.py           DeepSpeed's recovery script (ZeRO and bf16 runs)

The tags themselves — resolving ``--resume``, checking a tag is whole, the same data, committing a save — are
`squad.train.tags`' (below): this module runs them around DeepSpeed's save and load.

Resuming: `resolve_resume` turns ``--resume`` (auto, none, a run, its checkpoints folder, a tag) into the candidate
tags, best first (torch-free: the run folder's checks and the tools use it before anything heavy starts).
`Checkpointer.plan_resume` reads every file of the first candidate with ``weights_only`` on all ranks together
(`select_tag`): an unsafe file stops the run, a damaged tag is named and the one before it tried (a tag is damaged
too when its shard files miss an expert: `squad.io.expert_files.check_shards`); other training data than the tag's is
refused (`check_same_data`). If the tag was written on another topology, the plan names the conversion that lets this
run load it; `Checkpointer.load` converts and loads it with DeepSpeed, and a load that fails on some rank is printed
by that rank and passed over by every rank together (the plan then names the tag actually loaded).

**Converting on load** is the seam for every change of topology: a `Conversion` says when a tag needs it
(`Conversion.needed`, from the saved and the current `Topology`), the DeepSpeed config it loads with, and how to write
the converted tag (`Conversion.convert`). Today's one is `Universal`: ZeRO-1/2 (and bf16) optimizer state is
partitioned by data-parallel rank, so a tag written by N ranks loads on M through DeepSpeed's universal checkpoint
(``deepspeed.checkpoint.ds_to_universal``, then ``checkpoint.load_universal``), optimizer state exact. Expert
parallelism plugs in the same way: `Checkpointer.save` records the expert-parallel size in COMPLETE beside the world
size, `Topology` reads it back (an ``expert_parallel`` field, 1 for tags without it), and a `Conversion` appended to
`CONVERSIONS` re-shards the per-expert files (weights and their optimizer state) from the saved expert-parallel size
to the current one into ``.convert/<tag>``; `Conversion.after_load` restores anything DeepSpeed's own load leaves out.
Conversions are tried in order and the first that `Conversion.needed` says applies is used; one that must follow
another (re-sharded experts, then universal ZeRO state) can run the other inside its `Conversion.convert`.

Saving (`Checkpointer.save`) is collective: rank 0 prepares ``.saving/<tag>``, DeepSpeed writes every rank's files
(`EngineGuard` records a failed write instead of leaving the other ranks in DeepSpeed's barrier), every rank reports
its outcome and whether a stop was asked meanwhile, and rank 0 writes COMPLETE, renames the tag into place, points
``latest`` at it and prunes old tags. A failed write on any rank stops every rank with a `TrainingError` naming the
file; the previous checkpoint stays the latest.

Signals (`SignalWatch`): the first of ``train.save_on_signal`` (default SIGTERM, SIGUSR1, SIGHUP) asks for a stop;
the engine all-reduces the request with the step's loss check, so every rank agrees at the same step boundary with no
extra collective, and `Checkpointer.save` turns it into a save and `Preempted` (exit 75, EX_TEMPFAIL: rerun to resume).
A signal during a save lets it finish, then stops. A second signal, at least `SignalWatch.REPEAT_S` after the first,
exits at once (128 + its number), discarding a save in progress; launchers that forward a signal they received too
(``deepspeed.launcher.launch``) deliver it twice within milliseconds, which counts once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from squad.io.checkpoints import (
    CONVERTED,
    LATEST,
    SAVING,
    TAG_CONFIG,
    ZERO_SHARD,
    DamagedCheckpointError,
    UnsafeCheckpointError,
    find_resume_tag,
    load_checkpoint_file,
    marked_step,
    model_states_file,
    read_marker,
    tag_for,
)
from squad.io.expert_files import shard_names
from squad.io.files import WriteError, atomic_write_text, fail, failed_write, write_failure
from squad.train.signals import SignalWatch, signal_name
from squad.train.stops import EXIT_PREEMPTED, Preempted, TrainingError
from squad.train.tags import (
    ResumeSource,
    check_same_data,
    commit_tag,
    gather_objects,
    remove_save,
    select_tag,
)

log = logging.getLogger("squad.train")

@dataclasses.dataclass(frozen=True)
class Topology:
    """How a checkpoint's state is split: what a `Conversion` compares.

    Attributes:
        world_size: data-parallel ranks (ZeRO partitions the optimizer state over them).
        zero_stage: DeepSpeed ZeRO stage (0, 1, 2).
        partitioned: the optimizer state is split by rank (ZeRO 1/2, or DeepSpeed's bf16 optimizer): a tag then holds
            one optimizer file per rank.
        expert_shards: the expert weights (single-process names) kept in squad's shard files instead of DeepSpeed's
            (layers with expert_parallel > 1: `squad.train.expert_shards`); shard files load at any expert-parallel
            size, so only a change of this set needs a conversion (`squad.train.expert_layout.ExpertLayout`).
    """

    world_size: int
    zero_stage: int = 0
    partitioned: bool = False
    expert_shards: frozenset[str] = frozenset()

    @classmethod
    def of_tag(cls, tag_dir: Path) -> Topology | None:
        """What a tag was written with: its optimizer shards (one per rank when partitioned) and its marker; None
        for a tag without either (a checkpoint of another tool)."""
        shards = {int(m.group(1)) for p in Path(tag_dir).iterdir() if (m := ZERO_SHARD.match(p.name))}
        record = read_marker(tag_dir) or {}
        experts = frozenset(record["expert_shards"]) if isinstance(record.get("expert_shards"), list) else \
            frozenset(shard_names(tag_dir))
        if shards:
            return cls(max(shards) + 1, int(record.get("zero_stage", 1)), True, experts)
        if isinstance(record.get("world_size"), int):
            return cls(int(record["world_size"]), int(record.get("zero_stage", 0)), False, experts)
        return None


# ------------------------------------------------------------------------------------------ converting on load
class Conversion:
    """A change of layout a tag needs before this run can load it (the seam for every change of topology)."""

    name = "conversion"

    def needed(self, saved: Topology, now: Topology) -> bool:
        """Whether a tag written with ``saved`` needs this conversion to load with ``now``."""
        raise NotImplementedError

    def ds_config(self) -> dict:
        """DeepSpeed config keys the converted tag loads with (merged into the run's)."""
        return {}

    def convert(self, tag_dir: Path, out_dir: Path) -> None:
        """Writes the converted tag into ``out_dir`` (rank 0; the other ranks wait, then every rank loads it)."""
        raise NotImplementedError

    def after_load(self, engine: Any, tag_dir: Path) -> None:
        """Restores what loading the converted tag leaves out (called on every rank)."""


class Universal(Conversion):
    """A partitioned optimizer state written by N data-parallel ranks, loaded on M: DeepSpeed's universal checkpoint
    (``ds_to_universal``: every parameter's fp32 weights and Adam moments, whole; DeepSpeed re-partitions them on
    load, ``checkpoint.load_universal``)."""

    name = "universal"

    def needed(self, saved: Topology, now: Topology) -> bool:
        return saved.partitioned and saved.world_size != now.world_size

    def ds_config(self) -> dict:
        return {"checkpoint": {"load_universal": True}}

    def convert(self, tag_dir: Path, out_dir: Path) -> None:
        import argparse

        from deepspeed.checkpoint import ds_to_universal

        args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(out_dir), num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                ds_to_universal.main(args)
            except Exception as e:
                if failed_write(e):  # a full disk under torch's zip writer: "[enforce fail ...] unexpected pos"
                    raise fail(f"the universal checkpoint of {tag_dir.name}", out_dir, e) from e
                log_text = "".join(line for line in err.getvalue().splitlines(keepends=True) if "it/s]" not in line
                                   and "s/it]" not in line)  # the tail without tqdm's progress bars
                raise RuntimeError(f"converting {tag_dir} to a universal checkpoint failed: {type(e).__name__}: "
                                   f"{e} {log_text[-500:]}".rstrip()) from e

    def after_load(self, engine: Any, tag_dir: Path) -> None:
        """The universal load restores the trained parameters from their fp32 copies; buffers and frozen parameters
        come from the module weights of the tag."""
        import torch

        states = load_checkpoint_file(model_states_file(tag_dir))["module"]  # ZeRO-3: buffers only hold data
        trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
        rest = {n: t for n, t in states.items() if n not in trained}
        if rest:
            with torch.no_grad():
                engine.module.load_state_dict(rest, strict=False)


CONVERSIONS: tuple[Conversion, ...] = (Universal(),)


@dataclasses.dataclass
class LoadPlan:
    """The tag a run loads, passed-over damaged tags, and the conversion its topology needs (or None)."""

    ckpt_dir: Path
    tag: str
    skipped: list[Path]
    saved: Topology | None
    conversion: Conversion | None
    candidates: list[str] = dataclasses.field(default_factory=list)  # every tag the resume may try, best first

    @property
    def tag_dir(self) -> Path:
        return self.ckpt_dir / self.tag

    @property
    def step(self) -> int:
        return marked_step(self.tag_dir) or 0


# ------------------------------------------------------------------------------------ guarding DeepSpeed's I/O
class EngineGuard:
    """Routes a DeepSpeed engine's checkpoint reads through `load_checkpoint_file` and records its failed writes.

    DeepSpeed saves with collective calls between the writes; a write that raised on one rank only (a full disk)
    would leave the other ranks waiting in DeepSpeed's barrier. The failure is recorded instead (the half-written
    file stays until the caller removes the save) and `take` reports it once DeepSpeed's save has returned.
    """

    def __init__(self, engine: Any):
        self.errors: list[tuple[str, BaseException]] = []
        ce = engine.checkpoint_engine
        save = ce.save

        def guarded_save(state_dict: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            try:
                return save(state_dict, path, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - recorded and raised by the caller on every rank
                self.errors.append((str(path), e))
                return None

        def safe_load(path: str, map_location: Any = None) -> Any:
            return load_checkpoint_file(path, map_location=map_location)

        ce.save = guarded_save
        ce.load = safe_load
        copy_script = getattr(engine, "_copy_recovery_script", None)  # rank 0 copies zero_to_fp32.py beside the tags
        if copy_script is not None:
            def guarded_copy(*args: Any, **kwargs: Any) -> Any:
                try:
                    return copy_script(*args, **kwargs)
                except Exception as e:  # noqa: BLE001
                    self.errors.append((os.path.join(str(args[0]) if args else "", "zero_to_fp32.py"), e))
                    return None

            engine._copy_recovery_script = guarded_copy

    def take(self) -> tuple[str, BaseException] | None:
        """The first write that failed since the last call (then forgotten), or None."""
        first = self.errors[0] if self.errors else None
        self.errors.clear()
        return first


# ------------------------------------------------------------------------------------------- the checkpointer
class Checkpointer:
    """One run's checkpoints: plans and loads the resume, saves on a cadence and on signals (module docstring).

    Call order: `plan_resume` (every rank, before ``deepspeed.initialize``: its `ds_config` goes into the engine's
    config), `attach` (the engine), `load`, then `save` after every step and `save_final` at the end; `close` on the
    way out.

    Args:
        run_dir: the run folder.
        rank, world: this process's rank and the number of ranks.
        train: the run's ``TrainConfig`` (``ckpt_every``, ``stop_at``, ``keep_checkpoints``, ``save_on_signal``).
        partitioned: this run's optimizer state is split by rank (ZeRO 1/2, or bf16).
        config: the resolved run config (a plain dict), written into every tag (``config.yaml``: what a resume
            compares against, `squad.train.run_folder`).
        signals: the tool's `SignalWatch`, installed when the process started (else one is made here).

    ``data`` is the training data's identity (`squad.data.samples.SampleDataset.identity`), set before
    `plan_resume`: recorded in every tag's marker, and compared with the tag's on resume
    (`squad.train.tags.DataChangedError`).
    """

    def __init__(self, run_dir: str | Path, rank: int, world: int, train: Any, partitioned: bool,
                 config: dict | None = None, signals: SignalWatch | None = None):
        self.run_dir = Path(run_dir)
        self.config = config
        self.data: dict | None = None
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.rank, self.world = rank, world
        self.train = train
        self.topology = Topology(world, int(train.zero_stage), bool(partitioned))
        self.signals = signals or SignalWatch(train.save_on_signal, announce=rank == 0)
        self.signals.announce = rank == 0
        self.signals.at_exit(self.discard)
        self.total_steps = 0
        self.plan: LoadPlan | None = None
        self._peer_cause: str | None = None  # what stopped the first rank that asked (gathered at the stop's save)
        self.engine: Any = None
        self.guard: EngineGuard | None = None
        self.last_saved: int | None = None  # the step of the newest checkpoint of this run
        self._saving: Path | None = None
        self.conversions: list[Conversion] = list(CONVERSIONS)
        self._savers: list[Callable[[Path, Callable], None]] = []
        self._loaders: list[Callable[[Path, Path], None]] = []

    def expert_shards(self, names: set[str], conversion: Conversion) -> None:
        """This run keeps the expert weights ``names`` in squad's shard files; ``conversion`` moves a tag's experts
        between DeepSpeed's files and shard files when the saved set differs (tried first). Call before
        `plan_resume`."""
        self.topology = dataclasses.replace(self.topology, expert_shards=frozenset(names))
        self.conversions.insert(0, conversion)

    def also_save(self, save: Callable[[Path, Callable], None]) -> None:
        """``save(tag_dir, write)`` writes more of this rank's state into each tag, after DeepSpeed's files (every
        rank calls it; ``write(obj, path)`` is the engine's guarded writer, so a failure reaches every rank)."""
        self._savers.append(save)

    def also_load(self, load: Callable[[Path, Path], None]) -> None:
        """``load(loaded, saved)`` reads that state back after DeepSpeed loaded the tag: ``loaded`` is the tag folder
        DeepSpeed read (the converted one when converted), ``saved`` the tag as it was written."""
        self._loaders.append(load)

    # ---------------------------------------------------------------------------------------------- resume
    def plan_resume(self, source: ResumeSource | None) -> LoadPlan | None:
        """Chooses the tag to load (every rank: `select_tag`) and the conversion this run's topology needs.

        Raises:
            UnsafeCheckpointError, DamagedCheckpointError: as `select_tag`.
        """
        if source is None:
            return None
        warn = log.warning if self.rank == 0 else None
        tag = select_tag(source.ckpt_dir, source.tags, self.rank, self.world, warn)
        check_same_data(source.ckpt_dir / tag, self.data, self.config)
        saved = Topology.of_tag(source.ckpt_dir / tag)
        conversion = self._conversion(saved)
        skipped = [source.ckpt_dir / t for t in source.tags[: source.tags.index(tag)]]
        self.plan = LoadPlan(source.ckpt_dir, tag, skipped, saved, conversion, source.tags)
        return self.plan

    def _conversion(self, saved: Topology | None) -> Conversion | None:
        return next((c for c in self.conversions if saved is not None and c.needed(saved, self.topology)), None)

    def ds_config(self) -> dict:
        """DeepSpeed config keys the planned load needs (a converted tag's), merged into the run's."""
        plan = self.plan
        return plan.conversion.ds_config() if plan is not None and plan.conversion is not None else {}

    def attach(self, engine: Any, total_steps: int) -> None:
        """The DeepSpeed engine to save and load (its I/O guarded: `EngineGuard`) and the run's length."""
        self.engine = engine
        self.guard = EngineGuard(engine)
        self.total_steps = total_steps

    def load(self) -> dict | None:
        """Loads the planned tag (converted first when the plan says so); returns squad's client state, or None
        without a plan. Every rank calls it.

        A load that fails on some rank (a shard file that does not fit, a file that changed since it was verified) is
        printed by that rank, and every rank falls back together to the next candidate tag that verifies and needs
        the same conversion: the plan is updated in place (its tag, and the failed one among ``skipped``).

        Raises:
            WriteError: a conversion ran out of space (nothing of the run changed).
            DamagedCheckpointError: no candidate loads on every rank (each rank's problem named).
        """
        plan = self.plan
        if plan is None:
            return None
        while True:
            client, problem = self._load_tag(plan)
            problems = gather_objects(problem)
            if not any(problems):
                break
            failed = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
            if problem and self.rank != 0:  # rank 0 logs every rank's; this rank's own is printed here too
                print(f"[squad] rank {self.rank}: checkpoint {plan.tag_dir} could not be loaded: {problem}",
                      file=sys.stderr, flush=True)
            rest = plan.candidates[plan.candidates.index(plan.tag) + 1:] if plan.tag in plan.candidates else []
            tag = self._fallback(plan, rest)
            if tag is None:
                raise DamagedCheckpointError(
                    f"checkpoint {plan.tag_dir} could not be loaded ({failed}) and no earlier checkpoint in "
                    f"{plan.ckpt_dir} loads with this run's topology (remove the damaged checkpoints to start over, "
                    f"or train into a new --out folder)", plan.tag_dir)
            if self.rank == 0:
                log.warning("checkpoint %s could not be loaded (%s); falling back to %s", plan.tag_dir, failed,
                            plan.ckpt_dir / tag)
            plan.skipped.append(plan.tag_dir)
            plan.tag = tag
            plan.saved = Topology.of_tag(plan.tag_dir)
        if plan.ckpt_dir.resolve() == self.ckpt_dir.resolve():
            self.last_saved = plan.step
        return client

    def _fallback(self, plan: LoadPlan, tags: list[str]) -> str | None:
        """The first of ``tags`` that verifies on every rank and loads with the plan's conversion, or None."""
        if not tags:
            return None
        try:
            tag = select_tag(plan.ckpt_dir, tags, self.rank, self.world, log.warning if self.rank == 0 else None)
        except DamagedCheckpointError:
            return None
        same = type(self._conversion(Topology.of_tag(plan.ckpt_dir / tag))) is type(plan.conversion)
        return tag if same else None  # another conversion would need another DeepSpeed config

    def _load_tag(self, plan: LoadPlan) -> tuple[dict | None, str | None]:
        """Loads ``plan``'s tag on this rank (converted first); returns (client state, None), or (None, this rank's
        problem) for a load that failed here. A conversion's failure is every rank's (rank 0 converts)."""
        from squad.distributed import barrier, broadcast_object

        load_dir = plan.ckpt_dir
        scratch = self.ckpt_dir / CONVERTED
        if plan.conversion is not None:
            error = None
            if self.rank == 0:
                try:
                    shutil.rmtree(scratch, ignore_errors=True)
                    scratch.mkdir(parents=True)
                    log.info("converting %s (written by %d ranks) for %d ranks: %s checkpoint", plan.tag_dir,
                             plan.saved.world_size if plan.saved else 0, self.world, plan.conversion.name)
                    plan.conversion.convert(plan.tag_dir, scratch / plan.tag)
                except Exception as e:  # noqa: BLE001 - every rank must learn of it
                    full = isinstance(e, WriteError) or failed_write(e)
                    error = ("write", str(e) if isinstance(e, WriteError) else
                             write_failure(f"the {plan.conversion.name} conversion of {plan.tag}", scratch, e)) \
                        if full else ("other", f"{type(e).__name__}: {e}")
                    shutil.rmtree(scratch, ignore_errors=True)  # frees what the conversion wrote before any message
            error = broadcast_object(error)
            if error:
                kind, message = error
                if kind == "write":
                    raise WriteError(f"{message}; nothing of the run changed: {plan.tag_dir} is intact and the "
                                     f"partial conversion is removed. Make room (about the size of the checkpoint) "
                                     f"and rerun the same command", scratch, errno.ENOSPC)
                raise RuntimeError(message)
            load_dir = scratch
        client, problem = None, None
        try:
            _, client = self.engine.load_checkpoint(str(load_dir), tag=plan.tag)
            if client is None:
                problem = "DeepSpeed found nothing to load"
            else:
                if plan.conversion is not None:
                    plan.conversion.after_load(self.engine, plan.tag_dir)
                for load in self._loaders:
                    load(load_dir / plan.tag, plan.tag_dir)
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a rank-local failure: every rank learns of it and falls back together
            problem = f"{type(e).__name__}: {e}"
        finally:
            if plan.conversion is not None:
                barrier()
                if self.rank == 0:
                    shutil.rmtree(scratch, ignore_errors=True)
        return (None, problem) if problem else (client, None)

    # ------------------------------------------------------------------------------------------------ saving
    def stop_requested(self) -> bool:
        """Whether a signal asked this rank to stop (the engine all-reduces it with the step's loss check)."""
        return self.signals.requested is not None

    def save(self, step: int, client: Callable[[], dict], stop: bool = False) -> str | None:
        """The checkpoint step ``step`` calls for, if any; every rank calls it after every step.

        Args:
            step: optimiser steps done.
            client: squad's state to save beside DeepSpeed's (called only when a checkpoint is written).
            stop: every rank agreed that a signal asked for a stop (all-reduced during the step).

        Returns:
            None (go on), ``"stop_at"`` (``train.stop_at``: checkpointed, the run stops here).

        Raises:
            Preempted: a signal asked for a stop (before or during the save); the checkpoint at ``step`` is complete.
            TrainingError: a write failed on some rank (the previous checkpoint stays the latest).
        """
        t = self.train
        periodic = bool(t.ckpt_every) and step % t.ckpt_every == 0 and step < self.total_steps
        stop_at = step == t.stop_at and step < self.total_steps
        if not (stop or periodic or stop_at):
            return None
        if step != self.last_saved:
            stop = self._write(step, client()) or stop
        if stop:
            raise self._preempted(step)
        return "stop_at" if stop_at else None

    def save_final(self, step: int, client: Callable[[], dict]) -> None:
        """The checkpoint at the end of the run (a signal meanwhile changes nothing: the run is finishing)."""
        if step != self.last_saved:
            self._write(step, client())

    def stop_before_training(self) -> None:
        """At the start of the loop: from now on a signal asks for a checkpoint at the next step boundary (during
        start-up, the step-0 validation included, it exits 75 at once: `SignalWatch`)."""
        self.signals.start_training()

    def _stop_cause(self) -> str | None:
        """What asked this rank to stop (a signal's name, or the reason of a stop that is no signal); "" for a stop
        whose cause it does not know, None for none."""
        signum = self.signals.requested
        if signum is None:
            return None
        return signal_name(signum) if signum else (self.signals.reason or "")

    def _preempted(self, step: int, saved: bool = True) -> Preempted:
        what = self._stop_cause() or self._peer_cause or "a signal on another rank"
        latest = find_resume_tag(self.ckpt_dir)
        where = (f"checkpoint {self.ckpt_dir / tag_for(step)} holds step {step}" if saved and latest else
                 f"the newest checkpoint is {self.ckpt_dir / latest}" if latest else "no checkpoint yet")
        return Preempted(f"stopped by {what} at step {step}: {where}; run the same command again to resume "
                         f"(exit {EXIT_PREEMPTED})")

    def _write(self, step: int, client: dict) -> bool:
        """Saves the tag of ``step`` (collective); returns whether a signal asked for a stop meanwhile (agreed)."""
        from squad.distributed import broadcast_object

        tag = tag_for(step)
        staging = self.ckpt_dir / SAVING / tag
        what = f"checkpoint {tag}"
        error = None
        asked = False
        renamed = False  # the failure came after the tag was renamed into place
        if self.rank == 0:  # DeepSpeed's own mkdir failing on rank 0 alone would leave the others in its barrier
            try:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
            except OSError as e:
                error = write_failure(what, staging, e)
        if not broadcast_object(error):
            self._saving = staging
            self.guard.take()
            self.engine.save_checkpoint(str(staging.parent), tag=tag, client_state=client, save_latest=False)
            for save in self._savers:
                save(staging, self.engine.checkpoint_engine.save)
            failed = self.guard.take()  # recorded by the guard, so that every rank got through DeepSpeed's barriers
            outcomes = gather_objects((write_failure(what, *failed) if failed else None, self._stop_cause()))
            error = next((e for e, _ in outcomes if e), None)
            asked = any(s is not None for _, s in outcomes)
            self._peer_cause = next((f"{s} on rank {r}" for r, (_, s) in enumerate(outcomes) if s), None)
            if error is None and self.rank == 0:
                try:
                    record = {"step": step, "world_size": self.world, "zero_stage": self.topology.zero_stage,
                              "expert_shards": sorted(self.topology.expert_shards)}
                    if self.data is not None:
                        record["data"] = self.data
                    if self.config is not None:
                        import yaml

                        atomic_write_text(staging / TAG_CONFIG, yaml.safe_dump(self.config, sort_keys=False),
                                          "the config of the checkpoint")
                    commit_tag(self.ckpt_dir, tag, record, self.train.keep_checkpoints)
                except OSError as e:
                    error = write_failure(what, getattr(e, "path", None) or self.ckpt_dir / tag, e)
                    renamed = not staging.exists()
        if self.rank == 0:
            if error:
                error += self._after_failed_save(staging, step, renamed)
                log.error(error)
            else:
                log.info("checkpoint %s", self.ckpt_dir / tag)
        error = broadcast_object(error)  # every rank leaves once rank 0 has committed
        self._saving = None
        if error:
            raise TrainingError(error)
        self.last_saved = step
        return asked

    def _after_failed_save(self, staging: Path, step: int, renamed: bool) -> str:
        """Rank 0, after a save of ``step`` failed: removes what it left that no resume would use, and says what is on
        disk. A tag renamed into place before the failure (``renamed``) is complete: it stays when a resume picks it
        (`commit_tag` removes ``latest`` when it cannot point it there), else it is removed too, so that nothing
        holds the space unused."""
        remove_save(staging)  # never complete; frees what it held
        tag = tag_for(step)
        final = self.ckpt_dir / tag
        what = f"checkpoint {tag}"
        resume = find_resume_tag(self.ckpt_dir)
        gone = f"{what} was not saved (its partial files are removed)"
        if renamed and resume == tag:
            return (f"; {what} is complete in {final} nonetheless (the failure came after it was renamed into place; "
                    f"{self.ckpt_dir / LATEST} is removed, so a resume picks the newest complete checkpoint, this "
                    f"one): make room and rerun the same command to resume from it")
        if renamed:
            shutil.rmtree(final, ignore_errors=True)  # complete, but no resume would read it
            gone = f"{what} was not saved ({final} is removed: {LATEST} could not be pointed at it)"
        if resume:
            return (f"; {gone}. The previous checkpoint {self.ckpt_dir / resume} is intact: make room and rerun the "
                    f"same command to resume from it")
        return f"; {gone} and the run has no earlier checkpoint"

    def discard(self) -> None:
        """Rank 0: removes a save in progress (an interrupt, a second signal); nothing in a tag folder changes."""
        if self.rank == 0 and self._saving is not None:
            remove_save(self._saving)

    def close(self, finished: bool = True) -> None:
        """Removes what an interrupted save left (rank 0); restores the signal handlers after a run that finished, and
        ignores the signals after one that stopped early (`SignalWatch.ignore`)."""
        self.discard()
        if finished:
            self.signals.restore()
        else:
            self.signals.ignore()

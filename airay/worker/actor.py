"""The training actor: one process per bundle, holding a DeepSpeed engine across world changes.

The process lives for the whole run. When the world changes it leaves the old process group,
joins the new one and builds a fresh engine (ZeRO partitions depend on the world size), but it
never re-imports torch or DeepSpeed: that is what makes warm recovery fast.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from datetime import timedelta
from typing import Any

import ray

from airay import chaos, commtime
from airay.config import JobConfig, resolve_callable
from airay.data.source import StreamedSource, SyntheticSource
from airay.events import process_start_ts
from airay.policy import BatchPlan
from airay.worker.deepspeed_compat import disable_cpu_shm_comm, import_deepspeed, release_parallel_groups, \
    reset_zero3_globals
from airay.worker.device import assign_device
from airay.worker.dist import NCCL_ENV, abort_nccl_groups, collective_counts, group_status, listen_socket, \
    rendezvous_store, reset_group_count, shutdown_sockets, tcp_socket_fds
from airay.worker.failures import UserCodeError, describe, failure_kind, named
from airay.worker.logs import name_rank, quiet_deepspeed
from airay.worker.memory import forget_locals, release_heap, trim_heap
from airay.worker.build import build_model, hf_zero3, partitioned
from airay.worker.engine import backward_micro_batch, build_engine, drop_engine, engine_config

# How long a save's writes wait for the removals the memory budget started for them (a store that
# has not answered by then is on a lost node, or stuck: the files are written anyway).
ROOM_WAIT_S = 60.0


def _names_failures(method):
    """A method the driver classifies the outcome of (airay.health.classify_round): an exception
    it raises that a device, NCCL or airay's own code caused is raised under that name
    (airay.worker.failures.named), with the rank and the original traceback in its message."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            renamed = named(exc, self.rank)
            if renamed is None:
                raise
            raise renamed from exc

    return wrapper


class TrainWorker:
    """Ray actor body. The controller (through WorkerGroup) calls these methods in rounds.

    Training methods run one at a time; `abort_world` runs in its own concurrency group so the
    driver can break a rank out of a collective that will never complete.
    """

    def __init__(self, spec: dict[str, Any]):
        import warnings

        self.timeline = {"process_start_ts": process_start_ts(), "init_ts": time.time()}  # start-up parts
        import torch

        # Keep `ray job logs` readable: torch warns on every ZeRO collective about its own
        # renamed APIs; DeepSpeed's own notices are quieted below (airay.worker.logs).
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

        self.config = JobConfig.from_dict(spec)
        self.model_factory = resolve_callable(self.config.model.factory)
        self.loss_fn = resolve_callable(self.config.loss_fn)
        data = self.config.data
        self.data = SyntheticSource(resolve_callable(data.sample_fn), data.seed, data.kwargs) \
            if data.source == "synthetic" else StreamedSource(self.config.data_fetch_timeout_s)
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        # Which GPU this rank drives (airay.worker.device), fixed for the process's life: CUDA
        # sees the same devices across world changes.
        self.assigned = assign_device(self.gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available())
        self.device, self.backend = self.assigned.device, self.assigned.backend
        quiet_deepspeed(drives_gpu=self.device.startswith("cuda"))  # before DeepSpeed is imported
        if self.device.startswith("cuda"):
            torch.cuda.set_device(self.device)  # before any CUDA work: the context lives on this GPU
        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self.engine = None
        self._engine_outlived_leave = False  # the last engine dropped was still referenced after leave()
        self._hf_zero3 = None  # transformers' DeepSpeed integration, registered for a ZeRO-3 engine
        self.rank: int | None = None
        self.plan: BatchPlan | None = None
        # Ranks per replica (tensor x sequence parallel), this rank's replica and place in its
        # sequence group, and the world's size: set by a join (airay.parallel.layout).
        self.tp, self.sp, self.mp, self.replica, self.sp_rank, self.world = 1, 1, 1, None, 0, None
        self._world_sockets: dict[int, int] = {}
        self._joining_port: int | None = None  # the rendezvous port while a join is in it
        self._aborted_port: int | None = None  # a rendezvous the driver aborted (abort_world)
        self._listening = None  # the socket of free_port, for the world this rank will be rank 0 of
        # Where the step loop is (step, micro-batch, phase, and the collective calls made before
        # it got there: see heartbeat); read by `heartbeat` from the control thread, so it
        # answers while the training thread is stuck in a collective or user code.
        self._progress: dict[str, Any] = {"step": -1, "micro": -1, "phase": "start", "calls": (0, 0)}
        self._world_steps = 0  # steps completed in the world this rank is in
        self._old_groups: frozenset[str] = frozenset()  # process groups made before this world (group_status)
        for key, value in NCCL_ENV.items():  # read when a process group is made (airay.worker.dist)
            os.environ.setdefault(key, value)
        torch.set_num_threads(1)  # one CPU per worker bundle: don't oversubscribe the node
        commtime.install()  # before DeepSpeed binds the collectives (see airay.commtime)
        self._preempted_at: float | None = None
        from airay.checkpoint.staging import Writer

        # Writes checkpoint files off the step loop (airay.checkpoint.staging).
        self._ckpt_writer = Writer(int(self.config.checkpoint.chunk_mib * 2**20))
        if self.config.zero_stage == 3:  # an import the first build would otherwise make (airay.worker.build)
            from airay.worker.deepspeed_compat import preload_for_zero_init

            preload_for_zero_init()
        self._saving: dict | None = None  # the save staged last: step, directory, layout
        from concurrent.futures import ThreadPoolExecutor

        self._copier = ThreadPoolExecutor(1, thread_name_prefix="airay-ckpt-copy")  # peer copies
        self._copying: dict[int, Any] = {}  # step -> its peer copy's future
        self._persisted: dict[int, dict] = {}  # step -> this rank's files of it in node memory
        self._load_plan = None  # what prepare_load found, for load
        self.preemption_handled = _catch_sigterm(self._on_sigterm)
        from airay.checkpoint.tiers import remove_stale_scratch

        remove_stale_scratch()
        self.timeline["init_done_ts"] = time.time()

    def _on_sigterm(self, signum, frame) -> None:
        """A spot reclaim: finish the round (a rank cannot leave its peers mid-collective), report
        it, and the driver checkpoints and lets this rank go; exit anyway after the grace period."""
        import threading

        if self._preempted_at is None:
            self._preempted_at = time.time()
            timer = threading.Timer(self.config.checkpoint.preemption_grace_s, lambda: os._exit(128 + signum))
            timer.daemon = True
            timer.start()

    # ---- introspection -----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "ip": self.ip, "pid": os.getpid(), "device": self.device,
                "gpu_ids": self.gpu_ids, "backend": self.backend, "local_rank": self.assigned.local_rank,
                "cuda_visible_devices": self.assigned.visible_devices, "cuda_device": self.assigned.cuda_device,
                "sigterm_handled": self.preemption_handled}

    def free_port(self, host: str | None = None) -> int:
        """The rendezvous port of the next world this rank is rank 0 of: a socket listening on
        this node's address (or `host`), held until the join hands it to the world's store."""
        if self._listening is not None:
            self._listening.close()
        self._listening = listen_socket(host or self.ip)
        return self._listening.getsockname()[1]

    def ready(self) -> dict[str, Any]:
        """Up, with DeepSpeed imported: enough for a world that forms at once (the run's first),
        whose join builds the engine anyway. Returns info() and the start-up timeline."""
        import_deepspeed()
        self.timeline["ready_ts"] = time.time()
        return {**self.info(), "timeline": dict(self.timeline)}

    def warmup(self) -> dict[str, Any]:
        """Build and drop a one-rank engine, so this worker's first real join is warm.

        DeepSpeed's first engine build in a process costs seconds (lazy imports, op checks);
        paying it here, while the worker stands by, keeps it off the critical path of a resize.
        The run's first world skips it (`ready`): its joins are on the critical path either way.
        """
        t0 = time.perf_counter()
        plan = BatchPlan(1, self.config.micro_batch_size, self.config.micro_batch_size, 1)
        # A stand-in model through the same build and engine path: the user's model in a world of
        # one would be the whole model on this rank (ZeRO-3 partitions it over one).
        self.join(0, 1, "127.0.0.1", self.free_port("127.0.0.1"), plan.__dict__, stand_in=True)
        self.leave()
        self.timeline["warm_ts"] = time.time()
        return {**self.ready(), "warmup_s": time.perf_counter() - t0}

    # ---- world membership ----------------------------------------------------------------

    @_names_failures
    def join(self, rank: int, world_size: int, master_addr: str, master_port: int,
             plan: dict[str, int], fault: dict | None = None, init_weights: bool = True,
             stand_in: bool = False) -> dict[str, float]:
        """Leave any old world, join this one and build a fresh engine. Returns timings.
        `fault`: chaos struck as the join begins (airay.chaos_hook). `init_weights` False: a
        checkpoint load follows, so the model is built without its weights (airay.worker.build).
        `stand_in`: a small stand-in model instead of the user's (warmup)."""
        t0 = time.perf_counter()
        self.leave()
        self._enter("join", -1, fault, rank)
        if self._aborted_port == master_port:  # told already: a peer failed before this rank got here
            raise ConnectionAbortedError(f"rank {rank}: the world on port {master_port} was aborted before this rank "
                                         "joined it")
        self._joining_port = master_port
        try:
            return self._join(rank, world_size, master_addr, master_port, plan, t0, init_weights, stand_in)
        finally:
            self._joining_port = None  # abort_world's rendezvous breaker stops

    def _join(self, rank: int, world_size: int, master_addr: str, master_port: int, plan: dict[str, int],
              t0: float, init_weights: bool, stand_in: bool) -> dict[str, float]:
        deepspeed = import_deepspeed()
        import deepspeed.comm as dist
        import torch.distributed as tdist

        sockets_before = tcp_socket_fds()
        if self.backend == "gloo":
            disable_cpu_shm_comm()
        # LOCAL_RANK is the CUDA ordinal of this rank's GPU: DeepSpeed binds its device and NCCL's to it.
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(self.assigned.local_rank),
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        timeout = timedelta(seconds=self.config.timeouts.collective_timeout_s)
        listening, self._listening = (self._listening, None) if rank == 0 else (None, self._listening)
        store = rendezvous_store(master_addr, master_port, world_size, timeout, listening,
                                 aborted=lambda: self._aborted_port == master_port)
        reset_group_count()
        self._old_groups = frozenset(group_status(self.backend) or ())
        self._world_steps = 0
        tdist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        # DeepSpeed wraps the process group made above (it makes none when torch has one).
        deepspeed.init_distributed(dist_backend=self.backend, auto_mpi_discovery=False, verbose=False,
                                   rank=rank, world_size=world_size, timeout=timeout)
        self._at(-1, 2, "join")
        t_pg = time.perf_counter()
        if rank != self.rank:
            name_rank(rank)
        self.rank, self.plan = rank, BatchPlan(**plan)
        # Ranks per model replica: a replica's ranks train on its samples (the plan is over
        # replicas) and slice the model between them (DeepSpeed AutoTP).
        from airay.parallel.layout import Layout

        self.tp, self.sp = (1, 1) if stand_in else (self.config.tensor_parallel_size, self.config.sequence_parallel_size)
        self.mp, self.world = self.tp * self.sp, world_size
        where = Layout(world_size, tp=self.tp, sp=self.sp).coordinates(rank)
        self.replica, self.sp_rank = where.dp, where.sp
        reset_zero3_globals()
        from airay.worker.memory import peak_since, start_peak

        # The engine dropped before this join, if leave() could not free it: garbage by now, most
        # likely (the failed call has ended), freed before this world's engine is built.
        outlived, self._engine_outlived_leave = self._engine_outlived_leave, False
        if outlived:
            release_heap()
        rss_before = start_peak()
        cfg = engine_config(self.config.deepspeed, self.plan, self.device == "cpu", False)
        if stand_in:  # a world of one: nothing to slice the stand-in over
            cfg.pop("tensor_parallel", None)
            cfg.pop("sequence_parallel_size", None)
        self._hf_zero3 = hf_zero3(cfg) if partitioned(cfg) else None  # held while the engine lives
        factory, kwargs = (_stand_in, {}) if stand_in else (self.model_factory, self.config.model.kwargs)
        model = build_model(factory, kwargs, self.config.seed, cfg, init_weights=init_weights, call=self._user)
        model_rss, rss_before = peak_since(rss_before), start_peak()
        self.engine = build_engine(model, cfg, self.plan, self.device)
        from airay.checkpoint import staging

        # Their peak cost in host memory: the model (its partition, under ZeRO-3), then the engine
        # (optimizer state, gradient partitions, buffers).
        build_rss = {"model": model_rss, "engine": peak_since(rss_before)}
        # The model's own tensors, copied into the engine's flat buffers and freed, leave the C
        # heap now: a load's optimizer state comes next, in blocks too large to reuse them.
        trim_heap()
        staging.install(self.engine, self._ckpt_writer)
        self._at(-1, 3, "join")
        dist.barrier()
        # The TCP sockets that appeared while joining are this world's (store and gloo pairs).
        self._world_sockets = {fd: ino for fd, ino in tcp_socket_fds().items() if sockets_before.get(fd) != ino}
        self._aborted_port = None  # in a world again: an old abort is stale
        self._at(-1, 4, "join")
        t1 = time.perf_counter()
        # What this rank handed torch and DeepSpeed, read back from where they read it.
        handed = {"local_rank": int(os.environ["LOCAL_RANK"]), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "cuda_device": self.assigned.cuda_device, "engine_device": str(self.engine.device)}
        return {"process_group_s": t_pg - t0, "engine_s": t1 - t_pg, "join_s": t1 - t0, "build_rss": build_rss,
                "engine_outlived_leave": outlived, **handed}

    @ray.method(concurrency_group="control")
    def abort_world(self, rendezvous_port: int | None = None) -> int:
        """Break out of the current world: a peer is gone, so its collectives can never finish.

        gloo's abort() leaves its sockets open (torch 2.13), so a rank blocked in a collective
        would wait for the full timeout; shutting the world's sockets down wakes it now.
        NCCL communicators have a real abort.
        """
        if self.backend == "nccl":
            abort_nccl_groups()
        if rendezvous_port is not None:  # a world still forming (`rendezvous_port`: its store's)
            import threading

            self._aborted_port = rendezvous_port
            threading.Thread(target=self._break_rendezvous, args=(rendezvous_port,), daemon=True).start()
            return 0
        return 0 if self.backend == "nccl" else shutdown_sockets(self._world_sockets)

    def _break_rendezvous(self, port: int) -> None:
        """Shut down the connections of a rendezvous that can never finish (a peer died in it)
        until this rank's join on it has failed: the rank may connect only after being told (its
        join is queued, or in leave()); a join not yet begun refuses the port (join)."""
        deadline = time.time() + self.config.timeouts.collective_timeout_s
        while time.time() < deadline and self._aborted_port == port:
            if self._joining_port == port:
                shutdown_sockets(tcp_socket_fds(port=port))
            elif self._progress.get("phase") != "join":
                break  # the join with it ended (failed), or none is coming
            time.sleep(0.05)

    @ray.method(concurrency_group="control")
    def heartbeat(self) -> dict[str, Any]:
        """The step loop's progress, answered from the control thread (see WorkerGroup._gather):
        step, micro-batch and phase; `collectives`: [entered, left] collective calls since the
        phase began (every rank of a data-parallel world makes the same calls, so a rank that
        has entered fewer is the one its peers wait for: airay.health.position); `groups`: torch's
        own counters of this world's process groups, where torch has them (dist.collective_counts);
        `steps`: steps completed in this world (the first gets timeouts.first_step_timeout_s)."""
        p = self._progress
        entered, left = commtime.calls()
        beat = {"step": p["step"], "micro": p["micro"], "phase": p["phase"],
                "collectives": [entered - p["calls"][0], left - p["calls"][1]], "steps": self._world_steps}
        groups = collective_counts(group_status(self.backend), self._old_groups) if self.rank is not None else None
        if groups is not None:
            beat["groups"] = groups
        return beat

    def leave(self) -> None:
        """Drop the engine and the process group; safe to call when in neither."""
        import deepspeed.comm as dist
        import torch.distributed as tdist

        if self.engine is not None:
            # A save's host copies may still read the engine's tensors (a wait that is the leave's time).
            self._ckpt_writer.wait_live()
            self._ckpt_writer.take_wait()
            try:
                drop_engine(self.engine)
            except Exception as exc:  # a half-broken engine after a peer died; we drop it anyway
                print(f"[airay] rank {self.rank}: engine.destroy failed, engine dropped: {type(exc).__name__}: {exc}")
            dropped, self.engine = weakref.ref(self.engine), None
            release_heap()  # the dropped engine's state, before the next world's engine is built
            # Still referenced (a failed call's frames, a hook, a global): its memory stays taken
            # while the next world's engine is built; world_formed reports it.
            self._engine_outlived_leave = dropped() is not None
        self._hf_zero3 = None
        if tdist.is_available() and tdist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # DeepSpeed's wrapper on a broken world: torch's own call
                print(f"[airay] rank {self.rank}: leaving the world: {type(exc).__name__}: {exc}")
                if tdist.is_initialized():
                    tdist.destroy_process_group()
        release_parallel_groups()  # DeepSpeed's tensor-parallel groups were of the world just left
        self.rank = None

    # ---- checkpoints -----------------------------------------------------------------------

    @_names_failures
    def save(self, step: int, data_position: dict[str, Any] | None, memory_base: str,
             fault: dict | None = None, room: list | None = None) -> dict[str, Any]:
        """Stage this rank's part of `step` into its node's memory tier (DeepSpeed's file names
        carry the rank, so ranks sharing a node never clash). Returns once the small parts are
        cloned; parameters and optimizer state are written from the live tensors in the
        background (airay.checkpoint.staging), done before the next optimizer step changes them.
        `room`: the stores' removals of the steps the memory budget dropped for this save (refs,
        not waited for by the call): the writes begin once they are done."""
        from airay.checkpoint.layout import step_name
        from airay.checkpoint.reshard import layout_of
        from airay.checkpoint.tiers import node_dir
        from airay.worker.deepspeed_compat import save_keeping_gathered

        t0 = time.perf_counter()
        self._enter("save", step, fault)
        # A save whose world broke before it was persisted may still be writing: let it finish.
        self._ckpt_writer.wait(raise_errors=False)
        self._ckpt_writer.take_written()
        self._ckpt_writer.take_chunks()
        root = node_dir(memory_base, self.node_id)
        if room:
            self._ckpt_writer.after(functools.partial(ray.wait, room, num_returns=len(room), timeout=ROOM_WAIT_S))
        with save_keeping_gathered(self.engine):
            self.engine.save_checkpoint(save_dir=str(root), tag=step_name(step),
                                        client_state={"airay_step": step, "airay_data": data_position},
                                        save_latest=False)
        self._saving = {"step": step, "dir": str(root / step_name(step)), "t0": t0,
                        "layout": layout_of(self.engine) if self.rank < self.tp else {}}  # each slice's
        self._at(step, 2, "save")
        return {"save_s": time.perf_counter() - t0}

    @ray.method(concurrency_group="io")
    def persist(self, step: int, peer=None, peer_node: str | None = None) -> dict[str, Any]:
        """Finish writing this rank's files of `step`; returns {file: [size, crc32]} (computed as
        they were written) for the manifest. Then their copy to the peer node's store starts in
        the background (its outcome comes with the next persist's report: `copied`). Runs
        beside the step loop (its own thread)."""
        from pathlib import Path

        saving = self._saving
        if saving is None or saving["step"] != step:
            raise RuntimeError(f"rank {self.rank} has no save of step {step} to persist")
        self._ckpt_writer.wait()  # the files are complete (a failed write fails this save)
        written = {Path(p).name: list(v) for p, v in self._ckpt_writer.take_written().items()}
        chunked = {Path(p).name: v for p, v in self._ckpt_writer.take_chunks().items()}
        write_s = time.perf_counter() - saving["t0"]
        self._persisted[step] = {"dir": saving["dir"], "files": written}
        for old in sorted(self._persisted)[:-4]:  # what later uploads may still need, no more
            del self._persisted[old]
        copied = self._take_copies()
        if peer is not None:
            self._copying[step] = self._copier.submit(self._copy_to_peer, step, saving["dir"], written, peer, peer_node)
        return {"files": written, "chunk_sizes": chunked, "chunk_bytes": self._ckpt_writer.chunk_bytes,
                "layout": saving["layout"], "node_id": self.node_id,
                "peer_node": peer_node if peer is not None else None, "write_s": write_s, "copied": copied}

    def _copy_to_peer(self, step: int, directory: str, written: dict, peer, peer_node: str) -> dict[str, Any]:
        """Copy this rank's files of a step to the peer node's store (chunks through the object
        store, two in flight); the files stay in node memory meanwhile, so nothing waits for it."""
        from pathlib import Path

        from airay.checkpoint.actors import push_copy

        t0 = time.perf_counter()
        try:
            ok = all(push_copy(peer, step, Path(directory) / name, *v) for name, v in written.items())
            error = None if ok else "a file did not arrive whole"
        except Exception as exc:  # the peer (or its node) went, or the step was pruned meanwhile
            ok, error = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return {"step": step, "rank": self.rank, "peer_node": peer_node, "ok": ok, "error": error,
                "copy_s": time.perf_counter() - t0, "bytes": sum(v[0] for v in written.values())}

    def _take_copies(self) -> list[dict[str, Any]]:
        """Outcomes of the peer copies finished since the last call."""
        done = [s for s, f in self._copying.items() if f.done()]
        return [self._copying.pop(s).result() for s in sorted(done)]

    @ray.method(concurrency_group="upload")
    def upload(self, step: int, location: str) -> dict[str, Any]:
        """Upload this rank's files of `step` from its node's memory tier to durable storage
        (fsynced there on a filesystem); returns {file: [size, crc32]} of the bytes sent."""
        from pathlib import Path

        from airay.checkpoint.layout import step_name
        from airay.checkpoint.storage import Storage

        t0 = time.perf_counter()
        persisted = self._persisted.get(step)
        if persisted is None:
            raise RuntimeError(f"rank {self.rank} holds no files of step {step} to upload")
        storage = Storage(location)
        start = time.time()
        sent = {name: list(storage.upload_file(Path(persisted["dir"]) / name, f"{step_name(step)}/{name}"))
                for name in persisted["files"]}
        return {"files": sent, "upload_s": time.perf_counter() - t0, "window": [start, time.time()]}

    @_names_failures
    def prepare_load(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Find and verify, nearest copy first, every file this rank needs to load a checkpoint
        (no collective: a rank that finds no good copy fails alone, and every rank gives the
        step up). Returns which copies served and which were bad."""
        from airay.checkpoint.layout import Manifest, step_name
        import shutil

        from airay.checkpoint.loading import LoadPlan, Source, fetch_partial, fetch_verified, needed_files, \
            trained_keys
        from airay.checkpoint.reshard import layout_of
        from airay.checkpoint.tiers import node_dir, scratch_dir

        t0 = time.perf_counter()
        # This rank's model-parallel slice, over the data-parallel replicas (Manifest.slice).
        # This rank's tensor-parallel slice, partitioned over the other ranks of that slice (the
        # replicas; with sequence parallelism, every rank: ZeRO partitions over data x sequence).
        manifest = Manifest.from_json(spec["manifest"]).slice(self.rank % self.tp)
        rank, world = self.rank // self.tp, self.world // self.tp
        layout = layout_of(self.engine)
        source = Source(str(node_dir(spec["memory_base"], self.node_id) / step_name(spec["step"])),
                        {n: [(node, store) for node, store in holders if node != self.node_id]
                         for n, holders in spec["peers"].items()}, spec["durable"])
        paths, copies, bad = {}, {"local": 0, "peer": 0, "durable": 0}, []
        names = needed_files(manifest, rank, world, layout)
        trained = trained_keys(self.engine)
        # When the manifest has chunk CRCs (airay.checkpoint.ranges), files are read in part,
        # chunk by verified chunk: at another world size, the old partitions; with ZeRO-1/2, the
        # model-states file without the trained weights (rebuilt from the masters). Whole otherwise.
        partial = [n for n in names if ("optim_states" in n and manifest.world_size != world)
                   or (trained and n.endswith("_model_states.pt"))] if manifest.chunk_bytes else []
        for i, name in enumerate(n for n in names if n not in partial):
            self._at(spec["step"], i, "fetch")  # progress for the driver's hang watch, file by file
            f = manifest.files[name]
            paths[name], copy, met = fetch_verified(name, (f.size, f.crc32), source, spec["step"])
            copies[copy] += 1
            bad += met
        read = sum(manifest.files[n].size for n in paths)
        needed = read
        if partial:
            self._at(spec["step"], len(paths), "fetch")
            shutil.rmtree(scratch_dir() / "sparse", ignore_errors=True)
            got, met, part_read, part_needed, served = fetch_partial(
                manifest, rank, world, layout, partial, source, scratch_dir() / "sparse", trained)
            paths.update(got)
            bad += met
            for kind in served.values():
                copies[kind] += 1
            read, needed = read + part_read, needed + part_needed
        self._load_plan = LoadPlan(manifest, rank, world, paths, layout, trained)
        return {"copies": copies, "bad": bad, "files": sorted(paths), "fetch_s": time.perf_counter() - t0,
                "bytes": read, "bytes_needed": needed, "partial_files": len(partial)}

    @_names_failures
    def load(self, step: int, fault: dict | None = None) -> dict[str, Any]:
        """Load the checkpoint prepare_load found (DeepSpeed's own loader, its reads resharded to
        this world by the plan); returns the step, the data position and timings."""
        import shutil

        from airay.checkpoint.layout import step_name
        from airay.checkpoint.loading import load_engine
        from airay.checkpoint.tiers import scratch_dir

        t0 = time.perf_counter()
        self._enter("load", step, fault)
        plan, self._load_plan = self._load_plan, None
        if plan is None or plan.manifest.step != step:
            raise RuntimeError(f"rank {self.rank}: load of step {step} without prepare_load")
        stage_dir = scratch_dir() / "load"
        shutil.rmtree(stage_dir, ignore_errors=True)
        self.engine.checkpoint_engine.plan = plan
        try:
            load_path, client = load_engine(self.engine, plan, stage_dir, step_name(step))
        finally:
            self.engine.checkpoint_engine.plan = None
            shutil.rmtree(stage_dir, ignore_errors=True)
            shutil.rmtree(scratch_dir() / "sparse", ignore_errors=True)  # prepare_load's partial copies
        self._ckpt_writer.take_wait()  # a wait inside load_checkpoint is load time, not a step's
        release_heap()  # the load's state dicts and buffers, freed: off the RSS now, not at the next leave
        if load_path is None:
            raise RuntimeError(f"DeepSpeed loaded no checkpoint of step {step}")
        self._at(step, 2, "load")
        return {"step": int(client["airay_step"]), "data_position": client.get("airay_data"),
                "load_s": time.perf_counter() - t0, "reshard_s": plan.reshard_s, "resharded": plan.resharded}

    # ---- training ------------------------------------------------------------------------------

    @_names_failures
    def train(self, start: int, end: int, faults: dict[int, dict] | None = None,
              feed: dict[int, list] | None = None) -> list[dict[str, float]]:
        """Run global steps [start, end). Each result: loss_sum over this rank's samples, timings.

        `faults`: chaos, {step: fault} struck inside that step (airay.chaos).
        `feed`: a streamed dataset's pieces of these steps (and of a few after them, to prefetch).
        """
        if self.engine is None:  # it left its world: the round this one was queued behind failed
            raise ConnectionAbortedError(f"rank {self.rank} is in no world for steps {start}-{end - 1}: the round "
                                         "before them failed")
        out = []
        if feed:
            self.data.feed(feed, self.replica, self.plan)
        try:
            for step in range(start, end):
                out.append(self._step(step, (faults or {}).get(step)))
        except BaseException as exc:
            commtime.disarm()  # a stall_collective armed in the failed step must not strike in the next world
            # A peer died mid-collective, or our own code failed: shutting our world's sockets
            # down makes ranks still blocked on us fail fast instead of waiting for a timeout.
            shutdown_sockets(self._world_sockets)
            # After a CUDA error every call on this process's context fails (or hangs, freeing
            # an engine's memory or a communicator): the driver replaces the process instead.
            if failure_kind(exc) != "gpu":
                forget_locals(exc)  # the failed step's frames reach the engine: leave frees it now
                self.leave()
            raise
        if self._preempted_at is not None and out:
            out[-1]["preempted"] = True
        return out

    def _at(self, step: int, micro: int, phase: str) -> None:
        self._progress = {"step": step, "micro": micro, "phase": phase, "calls": commtime.calls()}

    def _enter(self, phase: str, step: int, fault: dict | None, rank: int | None = None) -> None:
        """A join, save or load begins: mark it for the driver's hang watch and strike its chaos.
        A rank stopped here stays behind the ranks that got past (airay.health.find_hung)."""
        self._at(step, 0, phase)
        if fault is not None:
            chaos.strike(fault, step, self.rank if rank is None else rank)
        self._at(step, 1, phase)

    def _step(self, step: int, fault: dict | None = None) -> dict[str, float]:
        import torch

        t0 = time.perf_counter()
        self._at(step, -1, "data")
        batches = self._user(self.data.micro_batches, step, self.replica, self.plan)
        data_wait = time.perf_counter() - t0
        sizes = self.plan.micro_sizes(self.replica)  # samples per micro-batch; 0: padded (weight 0)
        comm0 = commtime.seconds()
        local_s = 0.0  # data, chaos and forward: this rank's own work, before any collective
        loss_sum = torch.zeros((), device=self.device)  # summed on the device: no host sync per micro-batch
        for micro, (batch, samples) in enumerate(zip(batches, sizes)):
            t_fwd = time.perf_counter()
            self._at(step, micro, "forward")
            if fault is not None and micro == 0:
                self._user(chaos.strike, fault, step, self.rank)
            loss = self._user(self.loss_fn, self.engine, self._share(batch))
            local_s += time.perf_counter() - t_fwd
            self._at(step, micro, "backward")
            backward_micro_batch(self.engine, loss, samples, self.plan)
            if samples:
                loss_sum += loss.detach().float() * samples
        if fault is not None:
            chaos.step_done(fault)
        if self.sp > 1:  # each rank's loss covers its share of the sequences: the replica's is their mean
            import torch.distributed as tdist

            tdist.all_reduce(loss_sum, group=self.engine.mpu.get_sequence_parallel_group())
            loss_sum /= self.sp
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
        self._at(step, len(batches), "done")
        self._world_steps += 1
        # A replica's samples count once: its first rank reports them (loss, tokens, ids).
        real = [b for b, n in zip(batches, sizes) if n] if self.rank % self.mp == 0 else []
        if self.rank % self.mp:
            loss_sum.zero_()
        step_time = time.perf_counter() - t0
        comm = commtime.seconds() - comm0
        # Time the optimizer step waited for the previous save's live writes (airay.checkpoint.staging):
        # part of that checkpoint's blocking, not of this step's work.
        out = {"step": step, "loss_sum": float(loss_sum), "step_time_s": step_time, "data_wait_s": data_wait,
               "checkpoint_wait_s": self._ckpt_writer.take_wait(),
               "local_s": data_wait + local_s, "comm_s": comm, "compute_s": max(0.0, step_time - data_wait - comm),
               "tokens": sum(token_count(b) for b in real), "end_ts": time.time()}
        if self.config.data.record_sample_ids:
            out["sample_ids"] = [i for b in real for i in b["sample_id"].tolist()]
        return out

    def _share(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of a replica's micro-batch, on its device: all of it, or with sequence
        parallelism its share of every sequence (airay.parallel.sequence)."""
        if self.sp > 1:
            from airay.models.hf import labels_of
            from airay.parallel.sequence import shard

            batch = shard(batch, labels_of(batch), self.sp_rank, self.sp)
        return {k: v.to(self.device) for k, v in batch.items()}

    def _user(self, fn, *args, **kwargs):
        """Call user code; its exceptions become UserCodeError carrying the original traceback."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            # Running out of host or GPU memory is the machine's limit, not a bug in the code that
            # hit it; a CUDA error is the device's; a failed collective is a peer's; a block that
            # cannot be fetched is the data path's failure; an exception airay's code raised (the
            # user's calls into it, its data sources) is airay's (airay.worker.failures).
            if failure_kind(exc) != "user":
                raise
            raise UserCodeError(describe(exc, self.rank)) from exc


def _stand_in(seed: int = 0):
    """warmup's model: a layer, enough for DeepSpeed's first engine build in the process."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8))


def _catch_sigterm(handler) -> bool:
    """Route SIGTERM to `handler` instead of Ray's (which exits at once). Only the main thread
    can set signal handlers; elsewhere a SIGTERM stays a plain exit (a worker loss)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, handler)
    return True


def token_count(batch: dict[str, Any]) -> int:
    """Tokens in a micro-batch: the elements of its token ids ('input_ids' or 'tokens', an
    integer tensor of shape [batch, seq]); 0 for batches without a token dimension."""
    for key in ("input_ids", "tokens"):
        ids = batch.get(key)
        if ids is not None and getattr(ids, "dim", lambda: 0)() >= 2 and not ids.is_floating_point():
            return int(ids.numel())
    return 0

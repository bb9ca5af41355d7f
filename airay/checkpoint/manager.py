"""The driver's side of checkpoints: when to save, when a step is committed, what to load.

The driver never holds or reads checkpoint bytes. A save is collective and short: every rank
stages its own files into its node's memory tier (airay.checkpoint.staging) and returns. Then,
off the step loop, each rank finishes writing, copies its files to the next node in the ring
(its NodeStore), and reports every file's size and CRC-32; once all have, the driver commits the
step to memory by sending the manifest to every node's store. A durable step is then uploaded by
every rank in parallel, each its own files (one upload at a time per run: a newer durable step
supersedes one still waiting, UploadQueue); once all have, the driver writes the durable
manifest, last. What to load is chosen from manifests alone; the ranks verify what they read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from airay.checkpoint.actors import io_timeout_s
from airay.checkpoint.budget import NodeMemory, SavePlan, node_budgets, plan_save, rank_bytes
from airay.checkpoint.layout import CheckpointInfo, Manifest, load_order, step_name
from airay.checkpoint.tiers import DurableTier
from airay.health import RankOutcome

# The driver's waits for the ranks' background work of a save (files written, copies made,
# uploads) are bounded by io_timeout_s of the bytes the largest rank's files hold, from this base: far above what a healthy rank takes; a rank
# that takes longer has failed, and its save with it (checkpoint_failed).
SAVE_BASE_TIMEOUT_S = 300.0


# How long the memory figures the stores send with a commit serve the next save's budget (one
# call to every node fewer in each save's held time); older ones are asked for again.
FIGURES_MAX_AGE_S = 30.0


@dataclass
class PendingSave:
    """A save the driver follows from the ranks' staging to its last commit."""

    step: int
    durable: bool
    world_size: int
    t0: float  # unix time the ranks began to save
    blocking_s: float
    previous_commit_wait_s: float
    refs: list = field(default_factory=list)  # the ranks' persist calls, then their uploads
    members: list = field(default_factory=list)  # the ranks that saved it (they upload their own files)
    holders: dict = field(default_factory=dict)  # rank -> the nodes holding its files (its own, its peer)
    uploaded: dict = field(default_factory=dict)  # rank -> its upload's report, as they come in
    retried: bool = False  # the files of ranks lost mid-upload were handed to their nodes' stores
    lost: list = field(default_factory=list)  # those ranks
    attempts: int = 0  # uploads of the step tried again after a failure (checkpoint.upload_retries)
    manifest: Manifest | None = None
    memory_ts: float = 0.0  # when it was committed to memory
    upload_t0: float = 0.0
    plan_s: float = 0.0  # of blocking_s: the budget's plan (the stores' usage), before the ranks' call
    rank_save_s: float = 0.0  # of blocking_s: the slowest rank's own save call, as it timed it


class UploadQueue:
    """Which durable uploads run when (pure; the Checkpointer acts on its answers).

    A durable step is committed to memory first (loadable from there at once) and uploaded after,
    beside later saves, which never wait for it. One upload runs at a time: uploads share the
    storage's bandwidth, and one at a time keeps the durable tier's steps appearing in order. A
    durable step committed while one runs waits; a newer one supersedes a step still waiting: it
    stays in the memory tier, and uploading it after the newer one starts would only delay the
    newer one. The caller records every superseded step.
    """

    def __init__(self):
        self.running = None
        self.waiting = None

    def add(self, item):
        """A durable step was committed to memory: (the item to start now or None, the item it
        superseded or None)."""
        if self.running is None:
            self.running = item
            return item, None
        superseded, self.waiting = self.waiting, item
        return None, superseded

    def finished(self):
        """The running upload ended (done or failed): the waiting one, to start now, or None."""
        self.running, self.waiting = self.waiting, None
        return self.running

    def items(self) -> list:
        return [i for i in (self.running, self.waiting) if i is not None]

    def drop_waiting(self):
        """The waiting item, taken out of the queue (None if there is none)."""
        dropped, self.waiting = self.waiting, None
        return dropped


class Checkpointer:
    """Owns the checkpoint tiers of a run: collective save, background commits, what to load.

    A failed upload is tried again (`upload_retries`); a checkpoint that still fails is
    recorded (checkpoint_failed, with the newest durable step), and `max_failures` consecutive
    failures of a tier set `fatal`: the run cannot checkpoint, and the controller ends it."""

    def __init__(self, durable: str, zero_stage: int, keep_last: int, recorder, job: dict,
                 memory_base: str, memory_keep_last: int, upload_retries: int = 2, max_failures: int = 3,
                 budget_fraction: float = 0.25, budget_bytes: int | None = None, model_parallel: int = 1):
        self.durable = DurableTier(durable, job)
        self.model_parallel = model_parallel  # ranks per replica: each saves its slice's files (Manifest.slice)
        self.budget_fraction, self.budget_bytes = budget_fraction, budget_bytes
        self.budgets: dict[str, int] = {}  # each node's memory-tier budget, as last checked
        self._figures: tuple[float, list[dict]] | None = None  # (when, every store's figures), newest
        self.host_scale: dict[str, float] = {}  # budget factor per host, halved by each OOM kill there
        self.node_hosts: dict[str, str] = {}  # node id -> its host, as its store said
        self.last_manifest: Manifest | None = None  # the last committed save's: sizes the next one
        self.step_bytes: dict[int, dict[str, int]] = {}  # committed step -> bytes each node holds of it, whole
        self.durable.claim()  # another job's checkpoints here: fail before any actor starts
        self.memory_base, self.job = memory_base, job
        self.zero_stage, self.keep_last, self.memory_keep_last, self.rec = zero_stage, keep_last, memory_keep_last, recorder
        self.memory_steps: list[int] = []  # steps committed to the memory tier by this run, oldest first
        self._inflight: PendingSave | None = None  # the save whose persist is in flight
        self._uploads = UploadQueue()  # of PendingSave: durable steps committed to memory, to upload
        self._group = None
        self._room: list = []  # the stores' removals of steps dropped ahead of the next save (_make_room)
        self.step_wait: dict[int, float] = {}  # checkpoint_wait_s of each step (from the metrics)
        self.last_saved_step: int | None = None
        self.last_saved_durable = False
        self.last_durable_step: int | None = None  # the newest step committed to durable storage
        self.upload_retries, self.max_failures = upload_retries, max_failures
        self.consecutive_failures = {"memory": 0, "durable": 0}
        self.errors: dict[int, str] = {}  # why a step's checkpoint failed
        self.fatal: str | None = None  # set when a tier failed max_failures times in a row

    @property
    def root(self) -> str:
        return self.durable.storage.uri()

    # ---- saving -------------------------------------------------------------------------------

    def save(self, group, step: int, data_position: dict | None = None, durable: bool = True,
             faults: dict | None = None):
        """Collective save of `step` (with the data position at it, when data is streamed) into
        every node's memory tier, and to durable storage after when `durable`; returns the ranks'
        outcomes (all ok, or a loss to handle). `faults`: chaos struck in the ranks' saves."""
        t_wait = time.time()
        # The previous save's files must be written and copied first: a rank stages one save at a
        # time. An upload still running goes on beside this save.
        self._finish_persist()
        self._yield_step(step, durable)
        t0 = time.time()
        self._room_made(group)
        plan = self._plan(group, step)
        if plan.skip and durable and self._uploads.items():
            # A durable step is not skipped for room an upload holds: wait for it, then plan again.
            t_upload = time.time()
            self.wait()
            self.rec.event("checkpoint_budget", step=step, action="waited_for_upload", wait_s=time.time() - t_upload,
                           reason=plan.reason)
            plan = self._plan(group, step)
        if plan.skip:
            self.errors[step] = f"not saved: {plan.reason}"
            self.rec.event("checkpoint_budget", step=step, action="skipped", reason=plan.reason,
                           budget_bytes=min(self.budgets.values(), default=None), newest_durable_step=self.last_durable_step)
            return [RankOutcome(r, "ok") for r in range(len(group.active))]
        room: dict = {}  # the removals of the dropped steps, by node: the ranks' writes wait for them, the call does not
        if plan.drop or plan.drop_copies or plan.no_peer:
            self.memory_steps = [s for s in self.memory_steps if s not in plan.drop]
            if step in plan.drop:  # a replayed step: its first save's files go before this one writes there
                group.prune_memory(self.memory_steps, also_drop=list(plan.drop))
            elif plan.drop:
                # `step` kept: the ranks' save calls create its directory while the stores prune.
                room = group.prune_memory(self.memory_steps + [step], also_drop=list(plan.drop), wait=False)
            if plan.drop_copies:
                self._drop_copies(group, plan.drop_copies)
            action = "no_peer_copy" if plan.no_peer else "dropped_peer_copies" if plan.drop_copies else "dropped"
            self._record_plan(step, action, plan, plan.drop)
        t_call = time.time()
        outcomes, values = group.save(step, data_position, faults, room)
        if any(o.kind != "ok" for o in outcomes):
            bad = min((o for o in outcomes if o.kind != "ok"), key=lambda o: (not o.infra, o.rank))  # the lost one
            # Not a failure of the checkpoint path: a rank was lost (its recovery follows) and this
            # step is not committed; the run resumes from the one before.
            self.rec.event("checkpoint_failed", step=step, tier="memory", consecutive=None,
                           error=f"rank {bad.rank} {bad.kind} during the save: {bad.error}"[:500],
                           newest_durable_step=self.last_durable_step)
            return outcomes
        self._group = group
        self._inflight = PendingSave(step, durable, len(group.active), t0, time.time() - t0, t0 - t_wait,
                                     group.persist(step, plan.no_peer), list(group.active),
                                     plan_s=t_call - t0, rank_save_s=max(v["save_s"] for v in values))
        self.last_saved_step, self.last_saved_durable = step, durable
        return outcomes

    def _yield_step(self, step: int, durable: bool) -> None:
        """A rollback replays steps: saving `step` again writes the files its first save wrote, in
        the same step directories, under the new world's rank numbers, while that save's upload
        may still read them. An upload of it still waiting is dropped when this save is durable
        too (this save's upload replaces it); one running (or waiting, before a save that is not
        durable) is waited for."""
        waiting = self._uploads.waiting
        if durable and waiting is not None and waiting.step == step:
            self._uploads.drop_waiting()
            self.rec.event("checkpoint_upload_skipped", step=step, superseded_by=step,
                           uploading_step=self._uploads.running.step,
                           reason="the step is saved again (a rollback replayed it) while its first save waited "
                                  "for its upload: the new save's upload replaces it")
        while any(s.step == step for s in self._uploads.items()):
            self._finish_upload()

    # ---- the memory tier's budget (airay.checkpoint.budget) ------------------------------------

    def check_budget(self, group, nodes: list[str] | None = None, recent: bool = False) -> dict[str, int]:
        """Each node's budget from its memory figures now (at start, after a resize or an OOM
        kill); the first check is recorded (memory_budget). `recent` (a save's plan): the figures
        the stores sent with the last commit, when they are under FIGURES_MAX_AGE_S old and cover
        the world, instead of one more call to every node in the save's held time. A budget
        depends on /dev/shm's room (free plus this job's tiers, read at one instant), which this
        job's own writes and prunes since then do not change."""
        now, cached = time.time(), self._figures
        if recent and cached is not None and now - cached[0] <= FIGURES_MAX_AGE_S \
                and {m.node_id for m in group.active} <= {f["node_id"] for f in cached[1]}:
            raw = cached[1]
        else:
            raw = group.node_memory(nodes)
            if nodes is None and raw:
                self._figures = (now, raw)
        figures = [NodeMemory(**f) for f in raw]
        self.node_hosts.update({f.node_id: f.host for f in figures})
        budgets = node_budgets(figures, self.budget_fraction, self.budget_bytes, self.host_scale)
        if not self.budgets and figures:
            self.rec.event("memory_budget", nodes=len(figures), budget_bytes=min(budgets.values()),
                           fraction=self.budget_fraction, override_bytes=self.budget_bytes,
                           mem_total_bytes=max(f.mem_total for f in figures),
                           shm_free_bytes=min(f.shm_free for f in figures),
                           hosts=len({f.host for f in figures}))
        self.budgets.update(budgets)
        return budgets

    def _plan(self, group, step: int) -> SavePlan:
        """What this save gives up to keep every node's tier within its budget."""
        budgets = self.check_budget(group, recent=True)
        if not budgets:
            return SavePlan()
        own: dict[str, int] = {}
        if self.last_manifest is not None:  # the first save is sized by its own files, later ones by the last
            for member, nbytes in zip(group.active, rank_bytes(self.last_manifest, len(group.active))):
                own[member.node_id] = own.get(member.node_id, 0) + nbytes
        protected = {s.step for s in self._uploads.items()}
        copies: dict[str, dict[int, int]] = {}  # node -> protected step -> bytes of its peers' files there
        for node, per_step in self._peer_copies().items():
            for step, files in per_step.items():
                copies.setdefault(node, {})[step] = sum(files.values())
        kept = group.memory_usage()
        self.step_bytes = {s: b for s, b in self.step_bytes.items() if s in self.memory_steps}
        for step, held in self.step_bytes.items():  # a peer copy still arriving counts whole
            for node, nbytes in held.items():
                if node in kept:
                    kept[node][step] = max(kept[node].get(step, 0), nbytes)
        return plan_save(budgets, kept, protected, own, group.ring(), copies)

    def _peer_copies(self) -> dict[str, dict[int, dict[str, int]]]:
        """{node: {step: {file: size}}} of the peer copies of the steps uploads read (each rank
        uploads its own files from its own node; the copies only serve a rank lost mid-upload)."""
        out: dict[str, dict[int, dict[str, int]]] = {}
        for save in self._uploads.items():
            for name, f in save.manifest.files.items():
                for node in save.holders.get(f.rank, [])[1:]:
                    out.setdefault(node, {}).setdefault(save.step, {})[name] = f.size
        return out

    def _drop_copies(self, group, steps: tuple[int, ...]) -> None:
        """Remove the peer copies of `steps` (being uploaded) from the nodes holding them; their
        uploads' fallback is each rank's own node from now on."""
        for node, per_step in self._peer_copies().items():
            files = {step: sorted(per_step[step]) for step in steps if per_step.get(step)}
            if files:
                group.drop_copies(node, files)
        for save in self._uploads.items():
            if save.step in steps:
                save.holders = {rank: nodes[:1] for rank, nodes in save.holders.items()}
                self.step_bytes.pop(save.step, None)  # measured again (memory_usage) at the next plan

    def relieve_memory(self, group, nodes: list[str]) -> None:
        """Ray's memory monitor killed ranks on `nodes`: their hosts' budgets are halved and every
        node's tier keeps only its newest committed step (and what uploads still read) before
        replacements start there."""
        for node in nodes:
            host = self.node_hosts.get(node, node)
            self.host_scale[host] = self.host_scale.get(host, 1.0) / 2
        keep = set(self.memory_steps[-1:]) | {s.step for s in self._uploads.items()}
        dropped = [s for s in self.memory_steps if s not in keep]
        self.memory_steps = [s for s in self.memory_steps if s in keep]
        group.prune_memory(self.memory_steps, also_drop=dropped)
        self.rec.event("memory_tier_reduced", nodes=nodes, dropped_steps=dropped, kept_steps=self.memory_steps,
                       budget_scale={h[:24]: s for h, s in self.host_scale.items()})

    def note_wait(self, step: int, wait_s: float) -> None:
        """The step loop's wait at `step` for the previous save's live writes (its metric)."""
        self.step_wait[step] = wait_s

    def poll(self) -> None:
        """Move saves along without blocking: commits and uploads whose ranks are done."""
        running = self._uploads.running
        if running is not None and self._group.ready(running.refs):
            self._finish_upload()
        if self._inflight is not None and self._group.ready(self._inflight.refs):
            self._finish_persist()
            self._make_room()

    def wait(self, uploads: bool = True) -> None:
        """Block until the save in flight is committed to memory and, with `uploads`, until every
        durable upload has ended."""
        self._finish_persist()
        while uploads and self._uploads.running is not None:
            self._finish_upload()

    def _finish_persist(self) -> None:
        if self._inflight is None:
            return
        save, self._inflight = self._inflight, None
        try:
            reports = self._group.results(save.refs, self._save_timeout_s())
        except Exception as exc:  # a rank died or its files failed: the step stays uncommitted
            if self.last_saved_step == save.step:
                self.last_saved_step = None
            self._failed("memory", save.step, error_text(exc))
            return
        self.consecutive_failures["memory"] = 0
        save.manifest = Manifest.from_reports(save.step, save.world_size, self.zero_stage, self.job, reports,
                                              time.time(), self.model_parallel)
        self.last_manifest = save.manifest
        save.holders = {rank: [n for n in (r["node_id"], r.get("peer_node")) if n] for rank, r in enumerate(reports)}
        peers = sorted({r["peer_node"] for r in reports if r.get("peer_node")})
        held: dict[str, int] = {}  # with its peer copies, which may still be on their way
        for f in save.manifest.files.values():
            for node in save.holders[f.rank]:
                held[node] = held.get(node, 0) + f.size
        self.step_bytes[save.step] = held
        figures = self._group.commit_memory(save.step, save.manifest.to_json())
        if figures:  # each store's memory figures as it committed: the next save's budget
            self._figures = (time.time(), figures)
        save.memory_ts = time.time()
        self.memory_steps = [s for s in self.memory_steps if s != save.step] + [save.step]
        held = save.blocking_s + save.previous_commit_wait_s + self.step_wait.get(save.step, 0.0)
        self._record_copies([c for r in reports for c in r.get("copied", [])])
        self.rec.event("checkpoint_saved", step=save.step, path=f"memory:{step_name(save.step)}", tier="memory",
                       blocking_s=save.blocking_s, previous_commit_wait_s=save.previous_commit_wait_s,
                       plan_s=save.plan_s, rank_save_s=save.rank_save_s,
                       checkpoint_wait_s=self.step_wait.get(save.step, 0.0), held_s=held,
                       total_s=save.memory_ts - save.t0, bytes=save.manifest.bytes, world_size=save.world_size,
                       write_s=max(r["write_s"] for r in reports), peer_nodes=peers,
                       durable_pending=save.durable)
        if save.durable:
            start, superseded = self._uploads.add(save)
            if superseded is not None:
                self.rec.event("checkpoint_upload_skipped", step=superseded.step, superseded_by=save.step,
                               uploading_step=self._uploads.running.step,
                               reason="a newer durable step was committed while this one waited for an upload")
            if start is not None:
                self._start_upload(start)
        self._prune_memory()

    def _record_copies(self, copies: list[dict]) -> None:
        """The ranks' peer copies of earlier steps that finished (reported with a later save)."""
        by_step: dict[int, list[dict]] = {}
        for c in copies:
            by_step.setdefault(c["step"], []).append(c)
        for step, cs in sorted(by_step.items()):
            failed = [{"rank": c["rank"], "error": c["error"]} for c in cs if not c["ok"]]
            self.rec.event("checkpoint_copied", step=step, copy_s=max(c["copy_s"] for c in cs),
                           bytes=sum(c["bytes"] for c in cs), peer_nodes=sorted({c["peer_node"] for c in cs}),
                           failed=failed)

    def _start_upload(self, save: PendingSave) -> None:
        save.upload_t0 = time.time()
        save.refs = self._group.upload(save.step, self.durable.location, save.members)

    def _finish_upload(self) -> None:
        save = self._uploads.running
        failed = self._collect_uploads(save)
        if failed and not save.retried:
            # A rank died (or its upload failed) mid-upload: its files are still in its node's
            # memory (or in its peer's copy); that node's store uploads them instead.
            save.retried = True
            save.refs = []
            for rank in failed:
                names = sorted(n for n, f in save.manifest.files.items() if f.rank == rank)
                save.refs.append(self._group.upload_from_store(save.step, names, self.durable.location,
                                                               save.holders.get(rank, [])))
            save.lost = sorted(failed)
            return
        gone = sorted(r for r in save.lost if r not in failed and "missing" in save.uploaded.get(r, {}))
        if gone:
            self._give_up_upload(save, gone)
            return
        try:
            if failed:
                raise RuntimeError("; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())[:3]))
            reports = list(save.uploaded.values())
            sent = {n: tuple(v) for r in reports for n, v in r["files"].items()}
            expect = {n: (f.size, f.crc32) for n, f in save.manifest.files.items()}
            if sent != expect:
                wrong = sorted(n for n in expect if sent.get(n) != expect[n])
                raise RuntimeError(f"uploaded files differ from the manifest: {wrong[:3]}")
            committed = self.durable.commit(save.manifest)
        except Exception as exc:  # a rank died, storage failed or a file changed: not durable
            error = error_text(exc)
            if save.attempts < self.upload_retries:  # its files wait in the memory tier: try again
                save.attempts += 1
                self.rec.event("checkpoint_retry", step=save.step, tier="durable", attempt=save.attempts,
                               of=self.upload_retries, error=error)
                save.uploaded, save.retried, save.lost = {}, False, []
                self._start_upload(save)
                return
            if save.step == self.last_saved_step:
                self.last_saved_durable = False
            self._failed("durable", save.step, error)
        else:
            self.consecutive_failures["durable"] = 0
            self.last_durable_step = save.step
            pruned = self.durable.prune(self.keep_last, protect={save.step})
            self.rec.event("checkpoint_saved", step=save.step, path=self.durable.storage.uri(step_name(save.step)),
                           tier="durable", bytes=save.manifest.bytes, world_size=save.world_size,
                           upload_s=committed - save.upload_t0, upload_wait_s=save.upload_t0 - save.memory_ts,
                           total_s=committed - save.t0, pruned=pruned,
                           upload_windows=[r["window"] for r in reports], retried_ranks=sorted(save.lost))
        self._next_upload()

    def _next_upload(self) -> None:
        following = self._uploads.finished()
        if following is not None:
            self._start_upload(following)

    def _give_up_upload(self, save: PendingSave, ranks: list[int]) -> None:
        """No complete copy of `ranks`' files of the step is left (their node was lost before their
        peer copy was): no retry can make the step durable, and the storage did not fail (no
        failure counted). A resumed run replays the step from an earlier checkpoint."""
        if save.step == self.last_saved_step:
            self.last_saved_durable = False
        missing = sorted(n for r in ranks for n in save.uploaded[r]["missing"])
        self.rec.event("checkpoint_upload_skipped", step=save.step, lost_ranks=ranks, missing=missing[:4],
                       reason=f"no complete copy of rank(s) {ranks}' files is left: their node was lost before "
                              "their peer copy was complete")
        self._next_upload()

    def _failed(self, tier: str, step: int, error: str) -> None:
        """A checkpoint of `tier` failed for good: say so, with the newest step that is durable;
        `max_failures` in a row make the run's checkpoints `fatal`."""
        self.errors[step] = error
        self.consecutive_failures[tier] += 1
        n = self.consecutive_failures[tier]
        self.rec.event("checkpoint_failed", step=step, tier=tier, error=error, consecutive=n,
                       newest_durable_step=self.last_durable_step)
        if n >= self.max_failures and self.fatal is None:
            self.fatal = (f"{n} consecutive {tier} checkpoints failed (health.max_checkpoint_failures="
                          f"{self.max_failures}); the last, step {step}: {error}. "
                          f"{self.durable_text()} Fix the storage, then re-run to resume from it.")

    def durable_text(self) -> str:
        return (f"The newest durable checkpoint is step {self.last_durable_step} ({self.root})."
                if self.last_durable_step is not None else f"No checkpoint is durable ({self.root}).")

    def _collect_uploads(self, save: PendingSave) -> dict[int, str]:
        """Gather the upload calls in flight into save.uploaded; returns {rank: error} of those that failed."""
        keys = save.lost if save.retried else list(range(len(save.refs)))
        done, failed = self._group.each_result(save.refs, keys, self._save_timeout_s())
        save.uploaded.update(done)
        return failed

    def _save_timeout_s(self) -> float:
        """A rank's background work on a save (writing its files, uploading them) is bounded by
        the bytes of the largest rank's files in the last manifest (io_timeout_s)."""
        largest = max(rank_bytes(self.last_manifest, self.last_manifest.world_size), default=0) \
            if self.last_manifest is not None else 0
        return io_timeout_s(largest, SAVE_BASE_TIMEOUT_S)

    def _prune_memory(self, also_drop: tuple[int, ...] = (), wait: bool = True) -> dict:
        """Keep the newest memory_keep_last committed steps on every node (and steps still
        being uploaded, or waiting to be: their ranks upload from there), less `also_drop`;
        returns the stores' calls by node."""
        keep = set(self.memory_steps[-self.memory_keep_last:]) | {s.step for s in self._uploads.items()}
        if self._inflight is not None:
            keep.add(self._inflight.step)
        keep -= set(also_drop)
        self.memory_steps = [s for s in self.memory_steps if s in keep]
        return self._group.prune_memory(sorted(keep), wait=wait)

    def _make_room(self) -> None:
        """A save was committed: drop now the older steps the next save would drop for the
        budget (planned as if it came now, sized as this one), so that save's held time does
        not wait for their removal (at 100M parameters, 0.3-1.1 s of each save's 0.4-1.2 s on
        this machine: benchmarks/checkpoint.py). Not waited for here: the next save waits, if
        they are still going, before it plans (its writes must find the room made). The step
        just committed is never dropped ahead: the newest step stays loadable until the next
        one is committed (when the budget holds only one step, the save drops it, as before)."""
        if self._group is None or len(self.memory_steps) < 2:
            return
        newest = self.memory_steps[-1]
        plan = self._plan(self._group, newest)
        early = tuple(s for s in plan.drop if s != newest)
        if plan.skip or not early:
            return
        self._room = list(self._prune_memory(also_drop=early, wait=False).values())
        self._record_plan(newest, "dropped", plan, early, ahead=True)

    def _record_plan(self, step: int, action: str, plan: SavePlan, dropped: tuple[int, ...],
                     ahead: bool = False) -> None:
        """checkpoint_budget: what a save's plan gave up (`dropped`: the kept steps that went;
        `ahead`: only those, as the save before it committed, _make_room)."""
        extra = {"ahead": True} if ahead else {}
        self.rec.event("checkpoint_budget", step=step, action=action, dropped_steps=list(dropped),
                       dropped_copies_of=[] if ahead else list(plan.drop_copies),
                       no_peer_nodes=[] if ahead else sorted(plan.no_peer),
                       reason=plan.reason + (", ahead of the next save" if ahead else ""),
                       budget_bytes=min(self.budgets.values(), default=None),
                       planned_bytes=max(plan.use.values(), default=0), **extra)

    def _room_made(self, group) -> None:
        """Wait for the removals _make_room started (usually long done)."""
        room, self._room = self._room, []
        if room and not group.ready(room, timeout_s=60.0):
            self.rec.event("checkpoint_budget", action="waited_for_room", reason="a store's removal of dropped "
                           "steps did not finish in 60 s; the save goes on (the next plan measures the tiers again)")

    def settle(self, timeout_s: float) -> None:
        """The run ends early (it failed): commit what the ranks finish within `timeout_s` (a
        step whose files are written and uploaded is not lost to an unwritten manifest), then
        record what is left as failed, so no durable step disappears without a word."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            pending = self._inflight or self._uploads.running
            if pending is None:
                break
            if not self._group.ready(pending.refs, timeout_s=max(0.0, deadline - time.time())):
                break
            self._finish_persist() if pending is self._inflight else self._finish_upload()
        self._inflight = None
        for save in self._uploads.items():
            self.rec.event("checkpoint_failed", step=save.step, tier="durable",
                           error="the run ended before its upload to durable storage finished")
        self._uploads = UploadQueue()

    # ---- choosing what to load ----------------------------------------------------------------

    def candidates(self, group=None) -> list[CheckpointInfo]:
        """Complete checkpoints, in the order to try them: durable ones (manifests and a listing
        of sizes) and, given the worker group, memory ones whose every file some live node holds."""
        self.wait(uploads=False)
        found = self.durable.complete()
        newest = max((c.step for c in found), default=None)
        if newest is not None and (self.last_durable_step is None or newest > self.last_durable_step):
            self.last_durable_step = newest  # e.g. what an earlier run of the job left
        if group is not None:
            found += group.memory_checkpoints(self.job)
            for failure in group.catalog_failures:
                self.rec.event("checkpoint_catalog_timeout", **failure)
            group.catalog_failures.clear()
        return load_order(found)

    def latest(self, group=None) -> CheckpointInfo | None:
        found = self.candidates(group)
        return found[0] if found else None

    def reject(self, info: CheckpointInfo, reason: str, group) -> None:
        """Some file of `info` has no good copy: never try it again (a durable step is set aside,
        its memory copies dropped), with the event."""
        moved = self.durable.reject(info.step) if info.tier == "durable" else None
        if info.tier == "memory":
            self.memory_steps = [s for s in self.memory_steps if s != info.step]
            group.prune_memory(self.memory_steps, also_drop=[info.step])
        self.rec.event("checkpoint_rejected", step=info.step, tier=info.tier, path=info.path, moved_to=moved,
                       reason=reason)


def error_text(exc: BaseException) -> str:
    exc = getattr(exc, "cause", None) or exc  # a remote call's error: the exception it raised there
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"

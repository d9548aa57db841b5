"""The save pipeline behind `resumable.Checkpointer`, in parts that each do one thing.

`Checkpointer` (``resumable.manager``) is a facade: it checks its step arguments, has
`wiring.build_parts` build these parts from its `resumable.options.CheckpointOptions`,
and calls them in its public methods. The same parts serve one process and
several ranks; what differs is the coordination object they are given
(`resumable.group.Group`: with one process every exchange returns at once).

- `schedule.Schedule`: when to snapshot and when to persist (cadences, clocks, a
  persist owed after a busy worker, the measured persist cost; with several ranks,
  rank 0 decides the clock-based ones).
- `memory.MemoryTier`: the shared-memory snapshots: capture into the arena, overlap
  with the next step, adopt a dead launch's slots, verify and decode one.
- `persister.Persister`: when and where a persist runs, synchronous (`SyncPersister`)
  or in the background (`BackgroundPersister`) behind one interface; failures come
  back as `PersistError` at the next call; the mirror's flush.
- `restorer.Restorer`: the restore candidates in memory, the local root and the mirror,
  their order and fallback; verify, decode and apply.
- `saver.Saver`: snapshot, agree, persist or defer; the flush at close.
- `emergency.Emergency`: the checkpoint within a preemption's grace period.
- `root_claim.RootClaim`: the root's lock and run id, one writer per root.
- `last_step.LastStep` and `first_save.FirstSaveChecks`: what close checkpoints, and
  the warnings said once at the first save.
- `messages`: the typed messages between the trainer and its persist worker.

The persist wing, below the persister:

- `write`: one snapshot as files in storage, then the commit (`write_checkpoint`; with
  several ranks, `write_distributed`).
- `_worker`: the persist worker, its trainer-side client (`PersistWorker`) and its
  process's entry point (`worker_main`); `_worker_jobs.JobRunner`: one job's write,
  commit, retention and mirror hand-off; `_worker_process`: the worker process's
  launch and its tie to the trainer.
- `mirror.Mirror`: each local commit uploaded to a remote root.

Below them sit the layers that were always separate: `resumable.capture` (state to
tensors and a tree), `resumable.snapshot`/`resumable._shm` (the arena),
`resumable.commit` (the atomic commit), `resumable.coordination` (the store several
ranks' workers meet in) and `resumable.storage`.
"""

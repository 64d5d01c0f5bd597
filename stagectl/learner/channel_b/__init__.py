"""Channel-B: on-policy rollouts turned into training packs, in one package around one shared clock.

The trainer (`learner.loop`) knows only the `ChannelB` protocol (`protocol`): `decide` -> `run` ->
optimizer update -> `after_update` -> `metrics`, and `close`. `build.build_channel_b(plan.channel_b, ...)`
picks the implementation from the plan's source (`InProcessStep | ServerStep | AsyncServers`): step mode
(`step_mode`: roll out, judge and train inside the step) or async mode (`async_mode`). A Channel-B with
servers owns its rollout client and weight sync: it reports their counters and closes them.

One async B step, as loops around one work buffer (the rank's `ReadyPackQueue`), all reading one
`VersionClock` (`clock`: the policy version `ver`, the learner's step position, the sync fence):

    prefetcher thread (prefetcher, bursts, pacing)          learner rank (async_mode, loop)
    ------------------------------------------------        --------------------------------------------
    pacing: packs wanted? (queue counts, clock)             decide(step):
      | yes: one burst of <= gas packs                        health: probe servers, re-sync a restarted one
      v                                                       queue.hold(gas) -> all-reduce MIN over ranks
    rollouts.section()  (fenced; ver = clock.ver)             rank 0: B at the oldest version every rank
      | /infer/ requests (inference.client)                     holds gas packs of, else A (broadcast)
      v                                                         |
    packs.PackBuilder: parse -> match -> target ->              v
      segment -> groups -> collate                    +---> run(step): queue.take_held(ver)
      |                                               |       one forward/backward per pack (learner.packs)
      v                                               |         |
    +------------------------------------------+      |         v
    | ReadyPackQueue (queue): versioned FIFO   |------+     optimizer update (loop)
    | stale = ver < clock.ver - version_window |                |
    +------------------------------------------+                v
                     ^                                      after_update: every sync_every_steps
                     |                                        publisher.sync(): clock.sync() closes the
                     +---- packs outside the window drop ---- fence, rank 0 pushes, clock.advance(ver+1)

The clock is the only place `ver` lives: the publisher advances it (inside the fence, before it opens);
the queue judges staleness by it, a rollout section takes its version from it, pacing and the burst
state read it. A checkpoint saves the queue and the prefetcher's commit point (`records`); `build`
resumes them after pushing the checkpoint's weights.

Modules: protocol (the interface, `Decision`, the B-step ledger), build (which Channel-B; resume),
step_mode, async_mode, prefetcher (the thread), bursts (one request, its packs queued, server trouble; the
burst in progress), pacing (how many rollouts; retry policy), queue (ready packs; staleness), records
(what a pack holds; the checkpoint layout), clock, packs (rollouts -> micro-batches), rollouts (in process
or from servers), publisher (weight push), health (servers that die and come back), gallery (sampled B
steps on disk).
"""

"""Weight sync: the learner's weights onto the rollout servers, both sides of every transport.

Learner side: `client.WeightSyncClient.push_weights(state, version)` hands the state dict (or a
`TensorStream`) to one `base.WeightSender`, built by `factory.build_sender` from `vllm.sync.transport`.
Server side: `receiver.WeightSync` receives, verifies, stages and commits (the rollout server's weight
routes and `stream.WeightStreamServer` call it). One module per transport holds its sender and names its
receiving half: `http` (+ `stream`, its port), `collective`, `disk`. Shared: `wire` (chunk
format, checksum), `staging`, `delta`, `errors` (one type per failure, one HTTP status each).

Imports: the rollout package's leaves (`rollout.protocol`, `.engine`, `.paths`, `.tls`, `.errors`,
`.client` for its response helpers) and `config`; never a role (learner, rollout server).
"""

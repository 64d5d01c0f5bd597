"""Weight sync: the learner's weights onto the rollout servers, both sides of every transport.

Learner side: `client.WeightSyncClient.push_weights(state, version)` hands the state dict (or a
`TensorStream`) to one `base.WeightSender`, built by `factory.build_sender` from `vllm.sync.transport`.
Server side: one receiver per transport, in that transport's module next to its sender (`http.HttpReceiver`,
with `stream` its weight-stream port; `collective.GroupReceiver`; `disk.DiskReceiver`), each over the
staging, commit and failure handling they share (`receiver.WeightSync`), and each with its server routes
(`http_routes`, `collective_routes`, `disk_routes`: FastAPI, imported by the server only, so the learner
never loads it); the rollout server builds and mounts the configured ones. Shared: `protocol` (the weight endpoints' bodies and answers), `wire` (chunk
format, checksum), `staging`, `delta`, `errors` (one type per failure, one HTTP status each).

Imports: the wire code (`wire.protocol`, `.paths`, `.tls`, `.guards`, `.http` for reading a server's
answers) and `config`; never an engine (what it writes into is `gate.WeightTarget`), the inference client
(`inference`) nor a role (learner, rollout server).
"""

"""The rollout server (a role): the FastAPI app and its service, the batching worker, the engines, the
launcher of an embedded server. It imports the rollout package's leaves (`rollout.protocol`, `.guards`,
`.engine`, ...) and `weightsync`; nothing outside it imports it but the entry layer (cli, launch, doctor)."""

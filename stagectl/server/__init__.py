"""The rollout server (a role): the FastAPI app (`app`), what it does without HTTP (`service`), running it
(`serving`), the launcher of an embedded server (`launcher`) and swift's refused fields (`swift_fields`).
It imports `wire`, `engines` and `weightsync`; nothing outside it imports it but the entry layer (cli,
launch, doctor)."""

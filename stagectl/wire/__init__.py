"""The wire code every process shares (core, below `inference`, `engines`, `weightsync` and the server):
the inference contract (`protocol`), the errors a caller catches (`errors`), reading a server's answers
(`http`), the whole-call deadline of every outbound call (`deadline`), TLS contexts (`tls`), the request guards both server ports call (`guards`) and the rules on where
a server may read files (`paths`), and JSON that is not text (`text`: a lone surrogate escape, which every
reader of outside JSON refuses). Imports nothing of stagectl but the config
(`config.sampling`, and `config.rollout`'s default call bounds)."""

"""The rollout package's leaves (core): the wire format (`protocol`), the inference client (`client`,
`requests`, `errors`), the engine interface (`engine`) and the guards every HTTP layer shares (`guards`,
`paths`, `tls`). The server that serves them is the subpackage `rollout.server` (a role)."""

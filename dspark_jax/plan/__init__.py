"""Plans checked without weights (abstract models, ahead-of-time compiles): `serving` (does a Kimi-K3
deployment fit its devices, with the server's own programs from `server_programs`) and `training`
(does a distillation step fit the training mesh)."""

"""Envs: resolving what the user named, building vec envs (dummy, SB3's subproc, batched workers, EnvPool), and the
one automatic choice among them."""

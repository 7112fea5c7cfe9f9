"""A run's plumbing, apart from the RL step: its directory and lock (run_dir), identity and resume rules (identity,
identity_fields), checkpoint manifests (manifest), restricted unpickling (safe_unpickle), stop signals (preemption),
host allocator tuning (host_malloc) and the summary a finished run reports (summary)."""

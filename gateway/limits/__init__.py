"""Rate-limit windows: the `limits` storages the LimiterActor drives."""

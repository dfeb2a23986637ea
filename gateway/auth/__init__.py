"""Gateway keys: generation, hashing, and the store the CLI, the admin API and the AuthActor share."""

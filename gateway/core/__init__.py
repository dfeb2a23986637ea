"""The bottom layer: settings and config models, errors, the call record and usage types, tokens, the database."""

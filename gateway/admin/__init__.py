"""The admin API on the management plane: routes, input, views, audit, cache admin."""

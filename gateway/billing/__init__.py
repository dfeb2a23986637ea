"""Money: the journal, the ledger's rows, budgets, prices and usage reports."""

"""Search logic with no model: beam state, pruning rules, finalization rules."""

"""Runtime: decoder cache per cohort, scheduling, counters."""

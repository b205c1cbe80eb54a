"""Control Flow: the workflow DSL, validation, planning, execution, discovery and balancing."""

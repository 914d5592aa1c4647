"""The workflow side of znni: tasks, per-task execution, finalize, demo data."""

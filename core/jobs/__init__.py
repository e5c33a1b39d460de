"""The job domain over the database: the state machine, the queue, usage, dispatch, estimates."""

"""The job domain over the database: the state machine, the queue, usage, dispatch, and the
fleet's throughput history (time and cost of an estimate)."""

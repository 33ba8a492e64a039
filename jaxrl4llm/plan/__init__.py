"""`jaxrl4llm plan`: the meter. Compiles a run's programs for a TPU or GPU topology (or this CPU) on
any machine, reports memory per chip, and models the RL step's time at a length distribution."""

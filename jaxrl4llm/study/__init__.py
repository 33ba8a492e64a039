"""The study's tooling, apart from the RL loop: sweeps of runs over a grid of configs
(`sweep`, `jaxrl4llm sweep`), statistics across seeds (`stats`), the report that compares arms
over seeds (`study_report`, `jaxrl4llm report`) and the training curves of several runs
overlaid (`plot`, `jaxrl4llm plot`). It reads run folders the loop (`jaxrl4llm.train`) wrote."""

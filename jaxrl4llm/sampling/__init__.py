"""jaxrl4llm.sampling"""

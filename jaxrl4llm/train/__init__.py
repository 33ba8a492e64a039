"""jaxrl4llm.train"""

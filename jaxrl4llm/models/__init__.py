"""jaxrl4llm.models"""

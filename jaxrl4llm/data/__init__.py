"""jaxrl4llm.data"""

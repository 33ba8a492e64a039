"""jaxrl4llm.core"""

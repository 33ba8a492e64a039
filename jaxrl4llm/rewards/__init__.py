"""jaxrl4llm.rewards"""

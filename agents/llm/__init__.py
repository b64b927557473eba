"""agents/llm"""

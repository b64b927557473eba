"""agents/multiagent"""

"""The serverless face: env config -> engine, the RunPod SDK loop, the OpenAI HTTP surface.

Built in a later issue; see DESIGN.md.
"""

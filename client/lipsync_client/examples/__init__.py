"""lipsync_client/examples/ holds runnable voice-agent examples built on the client's integrations
(`python -m lipsync_client.examples.echo`: your microphone, spoken back by an avatar in the browser).

May import: lipsync_client and its integrations, the frameworks they need (pipecat, aiohttp); never the
server's rooms: an example talks to a running server through its endpoint only.
"""

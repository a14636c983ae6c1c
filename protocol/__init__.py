"""Sans-IO mesh protocol: frames, streams, handshake, schemas and limits. Bytes in, events out."""

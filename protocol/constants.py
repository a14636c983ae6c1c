"""The protocol's vocabulary: frame and stream types, subprotocol names, feature names, limits.

Nothing else in ``protocol/`` or ``mesh_node/`` spells these as literals. Every limit
is enforced on receive (see ``Limits``) and has a test that exceeds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# --- secure channel ---------------------------------------------------------------------------
NOISE_PROTOCOL_NAME: Final = b"Noise_XX_25519_ChaChaPoly_SHA256"
# The same handshake with AES-256-GCM, used only when both ends support it
# (negotiated in the WebSocket upgrade, protocol/link_cipher.py).
NOISE_PROTOCOL_AESGCM: Final = b"Noise_XX_25519_AESGCM_SHA256"
# The prologue binds the protocol version into the handshake hash: a peer speaking another
# version fails the handshake instead of misreading frames.
NOISE_PROLOGUE: Final = b"skippy-mesh/1"
# Domain separation for every Ed25519 signature we make (libp2p's "noise-libp2p-static-key:").
SIG_DOMAIN_STATIC_KEY: Final = b"skippy-mesh-noise-static-key:"
SIG_DOMAIN_OWNER_CERT: Final = b"skippy-mesh-owner-certificate/1\x00"
SIG_DOMAIN_TOPOLOGY: Final = b"skippy-mesh-topology/1\x00"
SIG_DOMAIN_SWARM_SOURCES: Final = b"skippy-mesh-swarm-sources/1\x00"  # signed swarm source lists
SIG_DOMAIN_INVITE: Final = b"skippy-mesh-invite/1\x00"  # invite tokens (protocol.invite)
NOISE_MAX_MESSAGE: Final = 65535  # Noise spec: a transport message is at most 65535 bytes
NOISE_TAG_BYTES: Final = 16
KEY_BYTES: Final = 32  # Ed25519 and X25519 public keys
SIGNATURE_BYTES: Final = 64
HANDSHAKE_PAYLOAD_VERSION: Final = 1

# --- records and frames -----------------------------------------------------------------------
# A WebSocket binary message carries 1..MAX_RECORDS_PER_MESSAGE records, each
# ``u16 length | Noise ciphertext``; a record's plaintext is a whole number of frames.
RECORD_LENGTH_BYTES: Final = 2
MAX_RECORD_PLAINTEXT: Final = NOISE_MAX_MESSAGE - NOISE_TAG_BYTES
FRAME_HEADER_BYTES: Final = 10  # type u8 | flags u8 | stream id u32 | length u32 (big endian)
MAX_FRAME_PAYLOAD: Final = MAX_RECORD_PLAINTEXT - FRAME_HEADER_BYTES

FRAME_DATA: Final = 0x00
FRAME_OPEN: Final = 0x01
FRAME_ACCEPT: Final = 0x02
FRAME_WINDOW: Final = 0x03
FRAME_CLOSE: Final = 0x04  # half close: the sender sends no more data on the stream
FRAME_RESET: Final = 0x05
FRAME_PING: Final = 0x06
FRAME_PONG: Final = 0x07
FRAME_MESSAGE: Final = 0x08  # a link-level control message (hello, gossip), stream id 0
FRAME_GOAWAY: Final = 0x09
FRAME_TYPES: Final = frozenset(range(FRAME_DATA, FRAME_GOAWAY + 1))
LINK_STREAM_ID: Final = 0  # frames that belong to the link, not to a stream
PING_PAYLOAD_BYTES: Final = 8
WINDOW_PAYLOAD_BYTES: Final = 4

# --- stream types (the first byte of an OPEN frame's payload) ----------------------------------
STREAM_SUBPROTOCOL: Final = 0x0D  # as in mesh-llm: a named, versioned subprotocol
STREAM_TYPES: Final = frozenset({STREAM_SUBPROTOCOL})

# --- the skippy-stage subprotocol (spec: "Mesh owns only the subprotocol open envelope") ---------
ENVELOPE_GEN: Final = 1
ENVELOPE_LENGTH_BYTES: Final = 2
SKIPPY_STAGE: Final = "skippy-stage"
SKIPPY_STAGE_MAJOR: Final = 2
KIND_CONTROL: Final = 0x01
KIND_TRANSPORT: Final = 0x02
KIND_ARTIFACT_TRANSFER: Final = 0x03
# A stage's signed source list, asked of the coordinator (only when it advertises
# BIT_SWARM_TRANSFER).
KIND_SWARM_SOURCES: Final = 0x04
# A holder asks its coordinator for a sibling replica's signed topology (only when
# the coordinator advertises BIT_SIBLING_SERVE).
KIND_SIBLING_TOPOLOGY: Final = 0x05
SKIPPY_STAGE_KINDS: Final = frozenset(
    {
        KIND_CONTROL,
        KIND_TRANSPORT,
        KIND_ARTIFACT_TRANSFER,
        KIND_SWARM_SOURCES,
        KIND_SIBLING_TOPOLOGY,
    }
)

# --- features --------------------------------------------------------------------------------
FEATURE_SKIPPY_STAGE: Final = f"{SKIPPY_STAGE}/{SKIPPY_STAGE_MAJOR}"
BIT_CONTROL: Final = "control"
BIT_STATUS: Final = "status"
BIT_CONTENT_IDENTITY: Final = "content-identity"
BIT_ARTIFACT_TRANSFER: Final = "artifact-transfer"
# The AES-256-GCM link cipher. Announced before Noise starts, as an RFC 6455
# WebSocket subprotocol the dialer offers and the listener selects (protocol/link_cipher.py).
WS_SUBPROTOCOL_AESGCM: Final = "skippy-mesh-aesgcm"
BIT_VERIFY_WINDOW: Final = "verify-window"  # transport phase verify (speculation)
BIT_NEXTN_DRAFTS: Final = "nextn-drafts"  # BEGIN/TOKENS flag DRAFTS (native-mtp speculation)
# The transport's sampling controls: a BEGIN with flag CONTROLS (min_p, typical_p, penalties,
# logit bias) and activations frames with flag IDS (the token ids the penalties read).
BIT_SAMPLING_CONTROLS: Final = "sampling-controls"
# Chunk-range requests (``length``) and kind 0x04 source lists; a serving node
# advertises it beside ``artifact-transfer``. Without it a peer gets whole-file requests only.
BIT_SWARM_TRANSFER: Final = "swarm-transfer"
# Serving across sibling replicas of one coordinator (kind 0x05; source lists that
# name a sibling replica's ready nodes). Advertised beside swarm-transfer.
BIT_SIBLING_SERVE: Final = "sibling-serve"
# One range request may span a run of several chunks (one stream, one authorization,
# its bytes verified chunk by chunk as they arrive); without it a peer gets one chunk a request.
BIT_CHUNK_RUNS: Final = "chunk-runs"
# Serving verified chunks of a partial (have-reports after a source request, source
# lists with fetch orders and per-holder chunks); without it a node serves installed files only.
BIT_PARTIAL_SERVE: Final = "partial-serve"
# This node checks chunks against a SHA-256 chain (each chunk from the chaining value
# before it, the last against the artifact's SHA-256: one hash per byte, the whole file proven
# by the chunks' checks); source lists sent to it may carry chains. A receiving capability:
# advertised whether or not the node serves.
BIT_CHUNK_CHAIN: Final = "chunk-chain"
STAGE_BUNDLE: Final = frozenset({BIT_CONTROL, BIT_STATUS, BIT_CONTENT_IDENTITY})

# --- message generations -----------------------------------------------------------------------
MESSAGE_GEN: Final = 1


@dataclass(frozen=True)
class Limits:
    """Every bound a link enforces on what it receives. The defaults are the protocol's; tests
    and operators may lower the timeouts (never raise the sizes past what peers expect)."""

    # sizes
    max_ws_message_bytes: int = 16 * (RECORD_LENGTH_BYTES + NOISE_MAX_MESSAGE)
    max_records_per_message: int = 16
    max_frame_payload: int = MAX_FRAME_PAYLOAD
    max_control_payload: int = 32 * 1024  # OPEN, RESET, GOAWAY, MESSAGE payloads
    max_handshake_message_bytes: int = 2048
    max_stream_message_bytes: int = 1024 * 1024  # one length-prefixed message on a stream
    max_reason_chars: int = 256
    max_envelope_bytes: int = 256
    max_gossip_peers: int = 128
    max_features: int = 32
    max_hello_extensions: int = 16  # unknown hello keys a node ignores (newer peers)
    max_feature_chars: int = 64
    max_address_chars: int = 256
    # streams and flow control
    max_streams_per_link: int = 32  # live streams opened by one side of a link
    stream_window_bytes: int = 4 * 1024 * 1024  # yamux-like per-stream receive window
    # The receive window grows (doubling) up to this while it limits a stream on a
    # long link (bandwidth-delay product); only bigger window updates go on the wire, which
    # every peer accepts, and both ends still start from ``stream_window_bytes``.
    stream_window_max_bytes: int = 16 * 1024 * 1024
    max_control_backlog_bytes: int = 1024 * 1024  # queued outbound control frames
    # time (seconds; the sans-IO state machines take "now" as a number)
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0  # a stream send that cannot progress this long fails

    def __post_init__(self) -> None:
        if self.max_frame_payload > MAX_FRAME_PAYLOAD:
            raise ValueError(f"max_frame_payload cannot exceed {MAX_FRAME_PAYLOAD}")


DEFAULT_LIMITS: Final = Limits()

# A Hello's optional host fingerprint: letters and digits, at most this long.
MAX_HOST_CHARS = 64

# A Hello's optional device list (ggml's devices: the CPU and any GPU): at most this many,
# each named in at most this many printable ASCII characters, of one of these types.
MAX_DEVICES: Final = 16
MAX_DEVICE_NAME_CHARS: Final = 64
DEVICE_TYPES: Final = ("CPU", "GPU", "IGPU", "ACCEL", "OTHER")

# --- relays: circuits through a mesh node for peers that cannot be dialled -------------------
# A circuit is a stream on each of the relay's two links, spliced byte for byte; the two ends
# run an ordinary WebSocket and the same Noise handshake over it, so the relay carries
# ciphertext only.
MESH_RELAY: Final = "mesh-relay"
MESH_RELAY_MAJOR: Final = 1
FEATURE_MESH_RELAY: Final = f"{MESH_RELAY}/{MESH_RELAY_MAJOR}"
KIND_CIRCUIT_CONNECT: Final = 0x01  # a dialer asks the relay for a circuit to a target
KIND_CIRCUIT_INCOMING: Final = 0x02  # the relay offers the target a circuit from a source
BIT_RELAY: Final = "relay"  # this node splices circuits for others
# This node accepts circuits from its relays, and understands relayed addresses in gossip.
BIT_RELAYED: Final = "relayed"
# A relayed address: the relay's address, this marker, the target's node id.
RELAYED_MARKER: Final = "/relayed/"
MAX_RELAYS: Final = 8  # relayed addresses one node advertises
MAX_DIRECT_ADDRESSES: Final = 4  # observed addresses one node offers for a direct link

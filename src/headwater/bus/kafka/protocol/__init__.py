"""The Kafka wire protocol, as much of it as headwater's own producer speaks (sans-I/O).

- ``codec``: the primitive types (fixed-width integers, strings, arrays, zigzag varints) and a
  reader that raises ``ProtocolError`` naming what was short or malformed;
- ``records``: record batches of magic 2 (KIP-98), the only format Kafka 4 takes, with their
  CRC-32C;
- ``api``: the requests the producer sends (ApiVersions, Metadata, InitProducerId, Produce) and
  their responses, in the non-flexible versions every Kafka from 2.1 to 4.x serves;
- ``errors``: the protocol's error codes, and which of them a retry can clear.

Nothing here opens a socket: bytes in, values out (``headwater.bus.kafka.connection`` does I/O).
"""

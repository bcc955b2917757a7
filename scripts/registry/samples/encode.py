#!/usr/bin/env python3
"""Write the sample Kafka record values of this directory, in Confluent's wire format, by hand.

    python3 encode.py AVRO_ID PROTOBUF_ID     # the schema ids the registry gave order.avsc / order.proto

writes order-v1.avro.hex and order.protobuf.hex (one line of lowercase hex each: the whole Kafka
record value). Standard library only: the Avro and Protobuf bodies are encoded here field by field,
so the layout is explicit (see ../NOTES.md, "Wire format"). The values are fixed (ORDER below).
"""
import struct
import sys
from datetime import datetime, timedelta, timezone

ORDER = {
    "order_id": 1001,
    "customer_id": 42,
    "amount_cents": 12345,
    "currency": "EUR",
    "created_at": datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=timezone.utc),
    "note": "first order",  # Protobuf only (google.protobuf.StringValue)
}
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def varint(n: int) -> bytes:
    """Unsigned LEB128 (Protobuf varint)."""
    assert n >= 0
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def zigzag(n: int) -> bytes:
    """Zigzag + varint: Avro int/long, and Confluent's message-index list."""
    return varint((n << 1) ^ (n >> 63))


def confluent_header(schema_id: int) -> bytes:
    """Magic byte 0, then the schema id as a 4-byte big-endian int."""
    return b"\x00" + struct.pack(">I", schema_id)


def avro_body(o) -> bytes:
    micros = (o["created_at"] - EPOCH) // timedelta(microseconds=1)
    cur = o["currency"].encode()
    return (
        zigzag(o["order_id"])  # long
        + zigzag(o["customer_id"])  # int
        + zigzag(o["amount_cents"])  # long
        + zigzag(len(cur)) + cur  # string: long length, UTF-8 bytes
        + zigzag(micros)  # long, logicalType timestamp-micros
    )


def pb_field(number: int, wire_type: int, payload: bytes) -> bytes:
    return varint(number << 3 | wire_type) + payload


def pb_varint(number: int, n: int) -> bytes:
    return pb_field(number, 0, varint(n))  # int32/int64 >= 0: plain varint, no zigzag


def pb_bytes(number: int, b: bytes) -> bytes:
    return pb_field(number, 2, varint(len(b)) + b)


def protobuf_body(o) -> bytes:
    delta = o["created_at"] - EPOCH
    seconds = delta.days * 86400 + delta.seconds
    nanos = delta.microseconds * 1000
    money = pb_varint(1, o["amount_cents"]) + pb_bytes(2, o["currency"].encode())
    timestamp = pb_varint(1, seconds) + pb_varint(2, nanos)  # google.protobuf.Timestamp
    note = pb_bytes(1, o["note"].encode())  # google.protobuf.StringValue: field 1 "value"
    return (
        pb_varint(1, o["order_id"])
        + pb_varint(2, o["customer_id"])
        + pb_bytes(3, money)  # Order.Money
        + pb_bytes(4, timestamp)
        + pb_bytes(5, note)
    )


def message_indexes(path) -> bytes:
    """Confluent's message-index list: zigzag varint count, then each index as a zigzag varint;
    the path [0] (the file's first message) is written as a single 0 byte instead of 02 00."""
    if list(path) == [0]:
        return b"\x00"
    return zigzag(len(path)) + b"".join(zigzag(i) for i in path)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    avro_id, proto_id = int(sys.argv[1]), int(sys.argv[2])
    avro = confluent_header(avro_id) + avro_body(ORDER)
    proto = confluent_header(proto_id) + message_indexes([0]) + protobuf_body(ORDER)
    for name, value in (("order-v1.avro.hex", avro), ("order.protobuf.hex", proto)):
        with open(name, "w") as f:
            f.write(value.hex() + "\n")
        print(f"{name}: {len(value)} bytes")


if __name__ == "__main__":
    main()

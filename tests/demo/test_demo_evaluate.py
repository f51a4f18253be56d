"""demo.evaluate's answering check: which facts a reply states."""

import itertools

from demo.corpus import iter_documents
from demo.evaluate import facts


def test_facts_of_a_reply():
    reply = "Hi Asha! The total for ORD-123456 is ₹1,240, paid in INR. Pickup at 560001 by 3:30 pm."
    assert facts(reply) == {"ORD-123456", "₹1,240", "560001", "3:30pm"}
    record = '{"order_id": "ORD-111111", "status": "baking", "total": 540, "slot": "1:00 pm"}'
    assert facts(record) == {"ORD-111111", '"status":"baking"', '"total":540', '"slot":"1:00pm"', "1:00pm"}
    assert facts("Sure, we are open every day.") == set()


def test_held_out_order_replies_have_their_order_id_as_a_fact():
    chats = (s for s in iter_documents("heldout") if s.kind == "order_status" and "ORD-" in s.messages[-1]["content"])
    for sample in itertools.islice(chats, 30):
        record = sample.messages[0]["content"]
        order_id = record[record.index("ORD-"):][:10]
        assert order_id in facts(sample.messages[-1]["content"])

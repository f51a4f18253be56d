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


def test_facts_name_the_store_the_customer_and_the_items():
    reply = ("Hi Sneha! Your order ORD-250436 (2 x Masala bun, 1 x Red velvet cake (1 kg)) is ready for pickup at "
             "Crumb Koregaon Park. The Mawa cake (CRB-106) has nuts.")
    assert facts(reply) == {"HiSneha!", "ORD-250436", "2xMasalabun", "1xRedvelvetcake(1kg)", "CrumbKoregaonPark",
                            "CRB-106"}
    assert "CrumbKothrud" in facts("... at Crumb Kothrud.") and "CrumbKoregaonPark" not in facts("... at Crumb Kothrud.")
    order = '{"customer": "Ravi Iyer", "items": [{"sku": "CRB-301", "qty": 5}]}'
    assert facts(order) == {'"customer":"RaviIyer"', '"sku":"CRB-301"', "CRB-301", '"qty":5'}


def test_held_out_order_replies_have_their_order_id_as_a_fact():
    chats = (s for s in iter_documents("heldout") if s.kind == "order_status" and "ORD-" in s.messages[-1]["content"])
    for sample in itertools.islice(chats, 30):
        record = sample.messages[0]["content"]
        order_id = record[record.index("ORD-"):][:10]
        assert order_id in facts(sample.messages[-1]["content"])

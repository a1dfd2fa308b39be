"""The contract between the exporter and every consumer of an export, computed once and read by both:
the export plan (`plan`: options, chunks, packages), the tensor specs of every function (`specs`),
the manifest schema, writer and reader (`manifest`) and what it records of the tokenizer
(`tokenizer`). The exporter writes what the plan says; the runtime reads the manifest. Neither
imports the other.
"""

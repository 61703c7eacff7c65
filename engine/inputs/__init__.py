"""What a request brings in before it is tokens: prompts (text or token ids) and
chats rendered through the tokenizer's template."""

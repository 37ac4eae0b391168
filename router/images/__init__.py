"""Images in requests: finding them (OpenAI `image_url` parts, TGI's markdown `![](url)`), reading
them (data: URLs; http(s) URLs when allowed, guarded against private addresses), checking them
with Pillow (format, pixel count, count per request), and the prompt chunks they travel in."""
